"""Inputs: verl's installed config files, YAML with lines, override tokens, the request, hardware, model architectures."""

from __future__ import annotations

from verl_safe_launch.inputs.architecture import from_config_dict, load_architecture, local_architectures
from verl_safe_launch.inputs.hardware import (
    DETECT_ENV,
    GPU_KEYS,
    Fact,
    HardwareProfile,
    as_profile,
    count_of,
    detect_hardware,
    hardware_fills,
    hardware_findings,
    merge_profiles,
    slurm_mem_gib,
)
from verl_safe_launch.inputs.keytypes import (
    KeyFacts,
    TypeSpec,
    dataclass_field_names,
    key_facts,
    names_read_with_get,
    verl_files,
    verl_prefix,
)
from verl_safe_launch.inputs.overrides import (
    OverrideToken,
    ToolSettings,
    cli_tokens,
    parse_override,
    split_tool_tokens,
)
from verl_safe_launch.inputs.request import ComposeRequest, request_from_args
from verl_safe_launch.inputs.verl_paths import PRIMARY_CONFIG, display_path, verl_config_dir, verl_package_dir
from verl_safe_launch.inputs.yamlfile import YamlDoc, YamlLeaf, parse_yaml, read_yaml

__all__ = [
    "DETECT_ENV",
    "GPU_KEYS",
    "PRIMARY_CONFIG",
    "ComposeRequest",
    "Fact",
    "HardwareProfile",
    "KeyFacts",
    "OverrideToken",
    "ToolSettings",
    "TypeSpec",
    "YamlDoc",
    "YamlLeaf",
    "as_profile",
    "cli_tokens",
    "count_of",
    "dataclass_field_names",
    "detect_hardware",
    "display_path",
    "from_config_dict",
    "hardware_fills",
    "hardware_findings",
    "key_facts",
    "load_architecture",
    "local_architectures",
    "merge_profiles",
    "names_read_with_get",
    "parse_override",
    "parse_yaml",
    "read_yaml",
    "request_from_args",
    "slurm_mem_gib",
    "split_tool_tokens",
    "verl_config_dir",
    "verl_files",
    "verl_package_dir",
    "verl_prefix",
]
