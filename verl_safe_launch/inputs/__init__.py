"""Inputs: verl's installed config files, YAML with lines, override tokens, the request, hardware, model architectures."""

from __future__ import annotations

from verl_safe_launch.inputs.architecture import from_config_dict, load_architecture, local_architectures
from verl_safe_launch.inputs.config_reads import ConfigRead, config_reads
from verl_safe_launch.inputs.engines import (
    engine_formats_json,
    engine_load_formats,
    engine_version,
    pinned_by,
    read_engine_formats,
)
from verl_safe_launch.inputs.hardware import (
    DETECT_ENV,
    GPU_KEYS,
    as_profile,
    count_of,
    detect_hardware,
    hardware_fills,
    hardware_findings,
)
from verl_safe_launch.inputs.keynames import did_you_mean, is_typo, typo_of
from verl_safe_launch.inputs.keytypes import (
    KeyFacts,
    TypeSpec,
    dataclass_field_names,
    key_facts,
    names_read_with_get,
    verl_files,
    verl_prefix,
)
from verl_safe_launch.inputs.knowledge import (
    cache_root,
    cached_bytes,
    cached_fact,
    cached_json,
    knowledge_dir,
    read_version,
)
from verl_safe_launch.inputs.machine import slurm_mem_gib
from verl_safe_launch.inputs.model_files import (
    ModelFiles,
    generate_model_files,
    missing_model_files,
    model_files,
)
from verl_safe_launch.inputs.overrides import (
    OverrideToken,
    ToolSettings,
    cli_tokens,
    parse_override,
    split_tool_tokens,
)
from verl_safe_launch.inputs.pins import project_dirs
from verl_safe_launch.inputs.profile import Fact, HardwareProfile, merge_profiles
from verl_safe_launch.inputs.read_budget import MAX_VALUES, composition_budget
from verl_safe_launch.inputs.registries import (
    REGISTRIES,
    Registry,
    group_estimators,
    max_model_len_paths,
    read_group_estimators,
    read_max_model_len_paths,
    read_registries,
    registered_names,
)
from verl_safe_launch.inputs.release import TESTED, VerlRelease, describe_need, verl_release, version_tuple
from verl_safe_launch.inputs.request import ComposeRequest, request_from_args
from verl_safe_launch.inputs.verl_checks import PROBES, Site, verl_check, verl_checks
from verl_safe_launch.inputs.verl_paths import (
    PRIMARY_CONFIG,
    VERL_ENV,
    choose_verl,
    chosen_verl,
    display_path,
    package_in,
    user_verl,
    verl_cache,
    verl_config_dir,
    verl_origin,
    verl_package_dir,
    verl_warning,
)
from verl_safe_launch.inputs.verl_values import charge_verl_yaml, verl_yaml_values
from verl_safe_launch.inputs.which_verl import (
    OFFLINE_ENV,
    ProjectVerl,
    VerlChoice,
    fetch_command,
    own_verl,
    project_verl,
)
from verl_safe_launch.inputs.yamlfile import YamlDoc, YamlLeaf, parse_yaml, read_yaml

__all__ = [
    "DETECT_ENV",
    "GPU_KEYS",
    "MAX_VALUES",
    "OFFLINE_ENV",
    "PRIMARY_CONFIG",
    "PROBES",
    "REGISTRIES",
    "TESTED",
    "VERL_ENV",
    "ComposeRequest",
    "ConfigRead",
    "Fact",
    "HardwareProfile",
    "KeyFacts",
    "ModelFiles",
    "OverrideToken",
    "ProjectVerl",
    "Registry",
    "Site",
    "ToolSettings",
    "TypeSpec",
    "VerlChoice",
    "VerlRelease",
    "YamlDoc",
    "YamlLeaf",
    "as_profile",
    "cache_root",
    "cached_bytes",
    "cached_fact",
    "cached_json",
    "charge_verl_yaml",
    "choose_verl",
    "chosen_verl",
    "cli_tokens",
    "composition_budget",
    "config_reads",
    "count_of",
    "dataclass_field_names",
    "describe_need",
    "detect_hardware",
    "did_you_mean",
    "display_path",
    "engine_formats_json",
    "engine_load_formats",
    "engine_version",
    "fetch_command",
    "from_config_dict",
    "generate_model_files",
    "group_estimators",
    "hardware_fills",
    "hardware_findings",
    "is_typo",
    "key_facts",
    "knowledge_dir",
    "load_architecture",
    "local_architectures",
    "max_model_len_paths",
    "merge_profiles",
    "missing_model_files",
    "model_files",
    "names_read_with_get",
    "own_verl",
    "package_in",
    "parse_override",
    "parse_yaml",
    "pinned_by",
    "project_dirs",
    "project_verl",
    "read_engine_formats",
    "read_group_estimators",
    "read_max_model_len_paths",
    "read_registries",
    "read_version",
    "read_yaml",
    "registered_names",
    "request_from_args",
    "slurm_mem_gib",
    "split_tool_tokens",
    "typo_of",
    "user_verl",
    "verl_cache",
    "verl_check",
    "verl_checks",
    "verl_config_dir",
    "verl_files",
    "verl_origin",
    "verl_package_dir",
    "verl_prefix",
    "verl_release",
    "verl_warning",
    "verl_yaml_values",
    "version_tuple",
]
