# Copyright 2024 Bytedance Ltd. and/or its affiliates
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

from .agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from .trainer_base import PPOTrainer, get_trainer_cls, register_trainer
from .trainer_colocate_async import PPOTrainerColocateAsync
from .trainer_separate_async import PPOTrainerSeparateAsync
from .trainer_sync import PPOTrainerSync

__all__ = [
    "PPOTrainer",
    "register_trainer",
    "get_trainer_cls",
    "PPOTrainerSync",
    "PPOTrainerColocateAsync",
    "PPOTrainerSeparateAsync",
    "AgentLoopWorkerTQ",
    "AgentLoopManagerTQ",
]
