"""The one exception type lbt raises for mistakes a user can fix."""


class ConfigError(ValueError):
    """A bad config value, a missing dataset, a batch that does not divide.

    Entry points catch it and print its message as one line (exit code 2),
    so the message must name the offending key or path and what is expected.
    """
