"""The one error of configuration, and the check that raises it naming the key."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key path and what was expected."""


def require(ok: bool, source: str, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {key}: {message}")
