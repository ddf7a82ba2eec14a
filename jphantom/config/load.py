"""Settings from a TOML file (``--config FILE.toml``): flat keys or the sections' tables, read
into the flat names :meth:`RunConfig.from_flags` takes."""

import dataclasses

from jphantom.config.sections import ALIASES, FLAT, SECTIONS
from jphantom.errors import ConfigError


def load_toml(path: str) -> dict:
    """Flat settings from a TOML file: flat keys (``-`` or ``_``) and/or sections (``[model]``,
    ``[parallel]``, ``[step]``, ``[train]``); a value of the wrong type is refused by name when
    the configuration is built."""
    import tomllib

    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a text (TOML) file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from None
    flat: dict = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                inner = inner.replace("-", "_")
                fields = {f.name for f in dataclasses.fields(SECTIONS[key])}
                if inner not in fields:
                    raise ConfigError(f"--config {path}: [{key}] has no setting {inner!r}; "
                                      f"known: {sorted(fields)}")
                name = "model" if (key, inner) == ("model", "name") else inner
                if name in flat and flat[name] != inner_value:
                    raise ConfigError(f"--config {path}: {name!r} is set twice, {flat[name]!r} "
                                      f"and [{key}] {inner} = {inner_value!r}: keep one")
                flat[name] = inner_value
        else:
            if key in flat and flat[key] != value:
                raise ConfigError(f"--config {path}: {key!r} is set twice, {flat[key]!r} and "
                                  f"{value!r}: keep one")
            flat[key] = value
    unknown = sorted(set(flat) - set(FLAT) - set(ALIASES))
    if unknown:
        raise ConfigError(f"--config {path}: unknown settings {unknown}; known: {sorted(FLAT)}")
    return flat
