# Copyright 2025 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

from . import actor, checkpoint, critic, disaggregation, engine, model, optimizer, reward, rollout
from .actor import *  # noqa: F401
from .checkpoint import *  # noqa: F401
from .critic import *  # noqa: F401
from .disaggregation import *  # noqa: F401
from .distillation import *  # noqa: F401
from .engine import *  # noqa: F401
from .model import *  # noqa: F401
from .optimizer import *  # noqa: F401
from .reward import *  # noqa: F401
from .rollout import *  # noqa: F401

__all__ = (
    actor.__all__
    + critic.__all__
    + reward.__all__
    + engine.__all__
    + optimizer.__all__
    + rollout.__all__
    + model.__all__
    + distillation.__all__
    + disaggregation.__all__
    + checkpoint.__all__
)
