"""The YAML reading of workload spec files, shared by the server (`joynexus.spec`) and the client:
PyYAML follows YAML 1.1, where `1e-3` (an exponent without a dot) is a string, not a number. The
spec's numbers are strict (a string is refused, not coerced), so spec files are read with YAML
1.2's float form as well: `learning_rate: 1e-3` is the number a user means."""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["SpecYamlLoader", "load_spec_yaml"]

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class SpecYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2's floats (`1e-3`, `2E5`) resolved as floats."""


SpecYamlLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
SpecYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_spec_yaml(text: str) -> Any:
    """`text` as YAML, floats as YAML 1.2 writes them (module docstring)."""
    return yaml.load(text, Loader=SpecYamlLoader)  # noqa: S506 (a SafeLoader)
