"""User-facing errors: the CLI prints the message and exits non-zero, no traceback."""
import errno
import re
from typing import Mapping

from envs.cache.schema import CacheError


class UserError(ValueError):
    """Bad input from the user (unknown setting, wrong value, bad file ...).

    The message names the place (file or field) and says what to do. ``field`` is the
    name of the argument the message starts with (``n_splits: must be ...``), and other
    arguments it mentions are quoted in backticks (``pass `force` ...``); a command line
    maps both to its own flags with :meth:`for_cli`, so library messages name what a
    Python caller typed and the CLI's what a shell user typed.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field

    def for_cli(self, flags: Mapping[str, str]) -> "UserError":
        """This error as a command line says it: the leading field name replaced by its flag in
        ``flags`` (or the flag put before a message that starts with the value), and every
        argument name quoted in backticks (```force```) replaced by its flag."""
        msg = str(self)
        if self.field and self.field in flags:  # "n_splits: ..." -> "--splits: ..."; "PATH: ..." -> "--out PATH: ..."
            flag = flags[self.field]
            msg = flag + msg[len(self.field):] if msg.startswith(self.field) else f"{flag} {msg}"
        msg = re.sub(r"`([a-z_]+)`", lambda m: flags.get(m.group(1), m.group(0)), msg)
        if msg == str(self):
            return self
        err = type(self)(msg, field=self.field)
        err.__cause__ = self.__cause__
        return err


USER_ERRORS = (UserError, CacheError)


def add_hint(exc: BaseException, hint: str) -> None:
    """Attach what the user can do next to ``exc`` (e.g. the ``--resume`` command of a failed run).

    The CLI appends the hints to its one ``error:`` line (:func:`hints`); a Python caller sees
    them as notes under the traceback (``add_note``).
    """
    exc.add_note(hint)
    exc.ccpo_hints = [*getattr(exc, "ccpo_hints", []), hint]


def hints(exc: BaseException) -> str:
    """``"; HINT; HINT"`` for the hints :func:`add_hint` attached, else ``""``."""
    return "".join(f"; {h}" for h in getattr(exc, "ccpo_hints", []))


#: errno values of a full disk or quota.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def disk_full_message(exc: BaseException) -> str | None:
    """One line for an exception caused by a full disk, else None.

    Looks through the chain (``__cause__``, ``__context__``, exception groups),
    because libraries wrap the OSError: orbax/tensorstore raise
    ``RESOURCE_EXHAUSTED ... No space left on device`` as a ValueError, and
    matplotlib or tensorboardX re-raise from their own frames.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            where = f" writing {e.filename}" if e.filename else ""
            why = e.strerror or str(e)
            return f"no space left on device{where}{f' ({why})' if why and 'No space' not in why else ''}; " \
                "free some space and run again"
        text = str(e)
        hit = next((t for t in _DISK_FULL_TEXT if t in text), None)
        if hit is not None:
            # tensorstore: '... Failed writing: "/path/of/the/file": ... No space left on device'
            paths = re.findall(r'"(/[^"]+)"', text)
            if paths:
                return f"no space left on device writing {paths[-1]} ({hit}); free some space and run again"
            line = next(ln for ln in text.splitlines() if hit in ln).strip()
            if len(line) > 300:
                line = line[:297] + "..."
            return f"no space left on device ({line}); free some space and run again"
        todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])
    return None
