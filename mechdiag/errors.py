"""The one exception type for bad user input: the CLI turns it into one stderr line and exit code 2."""


class UserError(Exception):
    """Bad input (missing or corrupt file, invalid config, mismatched shapes...). The message is shown as is."""
