"""``autoshard --config FILE COMMAND ...``: a TOML file standing in for flags.

One table per command; its keys are the command's long flags without the leading dashes
(``memory-budget`` or ``memory_budget``)::

    [plan]
    model = "gpt-tiny"
    mesh = "2x4"
    solver = "highs"
    verify = true

The file's flags are put on the command line right after the command name, so argparse
checks every value as it checks typed ones (types, choices), and a flag typed on the
command line after them wins. ``true`` turns a switch on; ``false`` leaves it off.
A table for another command is ignored; a key the command does not take, or a file that
is not TOML, is an error naming what would work.
"""

from __future__ import annotations

import tomllib


def _flags_of(subparser) -> dict[str, object]:
    """``--flag`` -> its argparse action, for every long option of ``subparser``."""
    return {
        opt: action
        for action in subparser._actions
        for opt in action.option_strings
        if opt.startswith("--")
    }


def expand_config(argv: list[str], parser) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the flags FILE gives the command."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise ValueError("--config needs a file: --config autoshard.toml")
    path = argv[i + 1]
    rest = argv[:i] + argv[i + 2 :]
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"cannot read config file {path!r}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {path!r} is not valid TOML: {err}") from None
    commands = parser._subparsers._group_actions[0].choices
    at = next((k for k, tok in enumerate(rest) if tok in commands), None)
    if at is None:
        return rest  # argparse will say a command is missing
    command = rest[at]
    unknown = [k for k, v in tables.items() if k not in commands or not isinstance(v, dict)]
    if unknown:
        raise ValueError(
            f"config file {path!r}: {', '.join(map(repr, unknown))} is not a [command] table; "
            f"tables: {', '.join(sorted(commands))}"
        )
    flags = _flags_of(commands[command])
    tokens: list[str] = []
    for key, value in tables.get(command, {}).items():
        flag = "--" + key.replace("_", "-")
        if flag not in flags or flag in ("--help", "--config"):
            raise ValueError(
                f"config file {path!r}: [{command}] has no flag {key!r}; it takes "
                + ", ".join(sorted(f[2:] for f in flags if f != "--help"))
            )
        if isinstance(value, bool):
            if value and flags[flag].nargs == 0:
                tokens.append(flag)
            elif flags[flag].nargs != 0:
                raise ValueError(
                    f"config file {path!r}: [{command}] {key} takes a value, not {value}"
                )
            continue
        tokens += [flag, str(value)]
    return rest[: at + 1] + tokens + rest[at + 1 :]
