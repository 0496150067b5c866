"""User-facing errors: the CLI prints the message and exits non-zero, no traceback."""
from envs.cache import CacheError


class UserError(ValueError):
    """Bad input from the user (unknown setting, wrong flag value, bad file ...).

    The message names the place (file, field, flag) and says what to do.
    """


USER_ERRORS = (UserError, CacheError)
