"""The plugin API version this core implements and the check of a plugin's declared range
(a leaf: imports nothing of hyperfsdp)."""

from __future__ import annotations

import re

#: The plugin API version this core implements. Minor versions add hooks and fields;
#: a major version changes or removes something plugins may rely on.
API_VERSION = (1, 2)
#: Module attribute in which a plugin declares the API versions it supports.
API_ATTRIBUTE = "HYPERFSDP_API"


class PluginLoadError(ImportError):
    """A plugin distribution's entry point could not be imported."""


class PluginVersionError(PluginLoadError):
    """A plugin does not support this core's plugin API version."""


_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
_COMPARE = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def _pad(version: tuple[int, ...], width: int) -> tuple[int, ...]:
    return version + (0,) * (width - len(version))


def api_version_string() -> str:
    return ".".join(map(str, API_VERSION))


def supports_api(spec: str, version: tuple[int, ...] = API_VERSION) -> bool:
    """Whether ``version`` satisfies ``spec``: comma-separated clauses such as
    ``">=1.0,<2"`` (operators ``>= <= == != > <``; missing parts count as 0).

    :raises ValueError: for a malformed spec.
    """
    clauses = [c for c in spec.split(",") if c.strip()]
    if not clauses:
        raise ValueError(f"empty plugin API range {spec!r}")
    for clause in clauses:
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(
                f"malformed plugin API range {spec!r}: expected clauses like '>=1.0' or '<2' "
                "separated by commas"
            )
        op, text = match.groups()
        wanted = tuple(int(x) for x in text.split("."))
        width = max(len(version), len(wanted))
        if not _COMPARE[op](_pad(version, width), _pad(wanted, width)):
            return False
    return True


def check_api(plugin: object, name: str | None, *, required: bool, origin: str = "") -> None:
    """Raise :class:`PluginVersionError` unless ``plugin`` supports this core's plugin API."""
    spec = getattr(plugin, API_ATTRIBUTE, None)
    where = f" from {origin}" if origin else ""
    core = f"hyperfsdp's plugin API is {api_version_string()}"
    if spec is None:
        if required:
            raise PluginVersionError(
                f"hyperfsdp plugin {name!r}{where} does not declare the plugin API versions it "
                f"supports; {core}. Its module must set {API_ATTRIBUTE} = '>=1.0,<2' (the range "
                "it was written for), or uninstall it"
            )
        return
    try:
        ok = supports_api(str(spec))
    except ValueError as exc:
        raise PluginVersionError(f"hyperfsdp plugin {name!r}{where}: {exc}") from None
    if not ok:
        raise PluginVersionError(
            f"hyperfsdp plugin {name!r}{where} supports plugin API {spec}, but {core}. "
            "Install a version of the plugin made for this hyperfsdp, or a hyperfsdp whose "
            "plugin API it supports"
        )
