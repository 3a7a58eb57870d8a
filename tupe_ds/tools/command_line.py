"""Every command's settings from up to three places, the command line first: flags, then a TOML
file (`--config FILE`, its keys spelled as the flags: `seq-length = 128`), then for tupe-pretrain
the settings its run folder recorded (OUT/history.jsonl). `--print-config` prints the result,
itself a valid --config file, with where each setting came from, and exits.

argparse does the parsing: the file's settings become the parser's defaults, so a flag given on
the command line wins, and each value goes through the flag's own type and choices."""

import argparse
import difflib
import json
import logging
import os
import re
import sys
import tomllib
from typing import Callable, Optional

from tupe_ds.tools import settings
from tupe_ds.tools.errors import NotRegularFile
from tupe_ds.tools.files import regular_file
from tupe_ds.tools.lock import file_kind

logger = logging.getLogger(__name__)

COMMAND_LINE = "command line"
DEFAULT = "default"
REQUIRED = "required: give it"
# dests no file sets: --verbose is read as the command imports (third_party_warnings.py)
NOT_SETTINGS = ("help", "config", "print_config", "local_rank", "verbose")
COMMAND_LINE_ONLY = ("help", "config", "print-config", "verbose")  # their names, as keys
MAX_CONFIG_BYTES = 1 << 20


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are what a busy user reads: one line, `PROG: error: ...`
    (argparse prints its whole usage block above it), a "did you mean" for each mistyped flag,
    then where the help is."""

    # {flag: what to give instead} of names other tools give a meaning this command does not
    # have (Megatron-LM's --save and --load: one --out holds both), said in place of a guess
    not_ours: dict = {}

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            flags = [option for option in self._option_string_actions if option.startswith("--")]
            for given in message.split(": ", 1)[1].split():
                name = given.split("=")[0]
                if name.startswith("--") and (hint := instead(self, name, name, flags)):
                    message += f"; {name}: {hint}"
        self.exit(2, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


def instead(parser: argparse.ArgumentParser, flag: str, name: str, names: list) -> str:
    """What to give in place of `name`, which `parser` does not have (`flag`: it as a flag):
    for a name other tools give another meaning (not_ours; --min_lr as Megatron-LM takes it),
    what it says, else the closest of `names` ("did you mean"); "" when none is close."""
    not_ours = getattr(parser, "not_ours", {})
    if flag.replace("_", "-") in not_ours:
        return not_ours[flag.replace("_", "-")]
    # a name cut short (--seq) means one it begins (--seq-len), not the closest (--seed); one
    # name per setting (TOML's keys are the flags without dashes), none hidden from --help
    actions, begun = parser._option_string_actions, {}
    shown = [n for n in names if getattr(actions.get(n) or actions.get("--" + n), "help", "")
             != argparse.SUPPRESS]
    if len(name.lstrip("-")) < 2:
        return ""
    for option in sorted((n for n in shown if n.startswith(name)), key=len):
        begun.setdefault(actions.get(option) or actions.get("--" + option) or option, option)
    close = list(begun.values())[:3] or difflib.get_close_matches(name, shown, n=1)
    return f"did you mean {' or '.join(close)}?" if close else ""


def positive(text: str) -> int:
    """argparse's type of a count: a whole number, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="a TOML file of settings, keys spelled as the flags (seq-length = "
                             "128, data = [\"prep/\"], bf16 = true); flags on the command line win")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved settings, as a --config file that says where "
                             "each came from, and exit")


PATH, NAMED, BLEND = "path", "named", "blend"  # the kinds of path settings (paths)


def paths(parser: argparse.ArgumentParser, *dests: str, named=(), blend=()) -> None:
    """Marks the settings whose values are paths: given in a --config file, a relative one is
    relative to the file's folder (as paths in a Makefile or a pyproject.toml are), so that a
    config file works from any working directory; on the command line, to the working directory.
    `named`: each value PATH or NAME=PATH (tupe-finetune's --valid), the NAME kept (an '=' after
    a '/' is part of the path); `blend`: --data's one folder, or weights and folders in turn,
    each folder as a `named` one."""
    actions = {action.dest: action for action in parser._actions}
    for kind, kind_dests in ((PATH, dests), (NAMED, named), (BLEND, blend)):
        for dest in kind_dests:
            actions[dest].path_kind = kind  # KeyError: a dest the parser does not have


def relative_to(folder: str, value, kind: str = PATH, expand: bool = False):
    """A `kind` path setting's `value`, a relative path in it taken as relative to `folder` (see
    paths); `expand`: ~ and $VARIABLES expanded first, as a shell would (a file's; a command
    line's were, by the shell). ValueError where a variable is not set, or where the path does
    not exist but the same path from the working directory does: a config file written before
    its paths were the file's."""
    if isinstance(value, list):
        if kind == BLEND and len(value) > 1:  # weight, folder, weight, folder...
            return [item if i % 2 == 0 else relative_to(folder, item, NAMED, expand)
                    for i, item in enumerate(value)]
        return [relative_to(folder, item, NAMED if kind == BLEND else kind, expand)
                for item in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # out = 2024: a folder
    if not isinstance(value, str) or not value:
        return value
    name, separator, path = value.partition("=")
    if kind != PATH and separator and name and os.sep not in name:
        return f"{name}={relative_to(folder, path, PATH, expand)}"
    path = os.path.expanduser(expanded(value)) if expand else value
    if os.path.isabs(path):
        return os.path.normpath(path)
    resolved = os.path.normpath(os.path.join(folder, path))
    if not os.path.exists(resolved) and os.path.exists(path) and \
            os.path.abspath(path) != resolved:
        raise ValueError(f"{value!r} is relative to the file's folder, {folder}, where "
                         f"{resolved} is not; {os.path.abspath(path)} (from the working "
                         f"directory) is: write that path, or one relative to {folder}")
    return resolved


def expanded(value: str) -> str:
    """`value` with its $VARIABLES and ${VARIABLES} replaced; ValueError naming one not set."""
    unset = [name for braced, bare in VARIABLE.findall(value)
             if (name := braced or bare) not in os.environ]
    if unset:
        raise ValueError(f"{value!r}: ${unset[0]} is not set in the environment (a path that "
                         "holds a '$' of its own goes on the command line)")
    return os.path.expandvars(value)


VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|(\w+))")


def passes_flags(parser: argparse.ArgumentParser, dest: str,
                 to: Callable[[], argparse.ArgumentParser]) -> None:
    """Marks list setting `dest` as flags handed on to another command (`to()`: its parser):
    paths among them are relative to a --config file as its own settings' are, and where the
    file and the command line give one of its settings, the command line's is taken."""
    next(action for action in parser._actions if action.dest == dest).passes_to = to


def flag_groups(tokens: list, parser: argparse.ArgumentParser) -> list:
    """[(the action or None, [its tokens])]: each flag of `tokens` with the values after it, as
    `parser` reads them (a flag it does not have, or values before any flag: None)."""
    options = {option: action for action in parser._actions for option in action.option_strings}
    groups = []
    for token in tokens:
        if token.startswith("-") and not number(token) or not groups:  # -1e-3, -inf: values
            groups.append((options.get(token.split("=", 1)[0]), [token]))
        else:
            groups[-1][1].append(token)
    return groups


def number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def passed_flags(folder: str, tokens: list, parser: argparse.ArgumentParser,
                 expand: bool = False) -> list:
    """`tokens` with the values of `parser`'s path flags relative to `folder` (relative_to)."""
    passed = []
    for action, group in flag_groups(tokens, parser):
        kind = getattr(action, "path_kind", None)
        option, separator, value = group[0].partition("=")
        if kind is None:
            passed += group
        elif separator:
            passed += [f"{option}={relative_to(folder, value, kind, expand)}", *group[1:]]
        else:
            values = group[1:] if action.nargs in ("+", "*") else group[1:2]
            passed += [option, *relative_to(folder, values, kind, expand), *group[1 + len(values):]]
    return passed


def merged_flags(first: list, then: list, parser: argparse.ArgumentParser) -> list:
    """The flags of `first` whose settings `then` does not give, then `then`'s."""
    given = {action.dest for action, _ in flag_groups(then, parser) if action is not None}
    return [token for action, group in flag_groups(first, parser)
            if action is None or action.dest not in given for token in group] + list(then)


def parse(parser: argparse.ArgumentParser, argv=None, **options) -> argparse.Namespace:
    """`resolve`'s namespace."""
    return resolve(parser, argv, **options)[0]


def resolve(parser: argparse.ArgumentParser, argv=None, recorded: Optional[Callable] = None,
            unset: Optional[Callable] = None, rest_into: Optional[str] = None) -> tuple:
    """(`parser`'s namespace, {dest: where its value came from}) from `argv` (default:
    sys.argv[1:]), its --config FILE and the `recorded` layer, flags first; with
    --print-config, prints the settings and exits 0. `recorded(namespace)`: (where they came
    from, {dest: value}) of settings below the file's, filling all that the command does not
    give (tupe-pretrain: the run's history's, found through --out). `unset(namespace)`: {dest:
    (value, where)} of the flags left unset whose value comes from elsewhere (tupe-pretrain: the
    DeepSpeed config's), for --print-config. `rest_into`: the list setting that the arguments the
    parser does not know go into, after its --config file's (tupe-compare's flags for
    tupe-pretrain)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv[:argv.index("--")] if "--" in argv else argv):
        parser.print_help()  # before any other flag's or file's error
        raise SystemExit(0)
    flags = {action.dest: action for action in parser._actions  # what a --config file may set
             if action.option_strings and action.dest not in NOT_SETTINGS}
    on_command_line = command_line_flags(parser, argv) & flags.keys()
    defaults = {dest: action.default for dest, action in flags.items()}
    required = [action for action in flags.values() if action.required]
    for action in required:  # checked below, once every layer is in
        action.required = False
    if "--print-config" in argv:  # the settings, without the positionals a run of it needs
        for action in parser._actions:
            if not action.option_strings and action.required:
                action.nargs, action.required = "*" if action.nargs == "+" else "?", False
    config_path = config_file(parser, argv)
    layers = [(config_path, read_config(parser, flags, config_path))] if config_path else []
    known = rest_into is not None
    args, rest = parse_over(parser, defaults, layers, argv, known)
    layer = recorded(args) if recorded else None  # fills every setting the command leaves
    if layer:
        given = on_command_line.union(*(values for _, values in layers))  # not taken from it
        layers.insert(0, (layer[0], checked_layer(parser, flags, layer[0], {
            dest: value for dest, value in layer[1].items() if dest not in given})))
        args, rest = parse_over(parser, defaults, layers, argv, known)
    sources = {dest: DEFAULT for dest in flags}
    for where, values in layers:
        sources.update({dest: where for dest in values})
    sources.update(dict.fromkeys(on_command_line, COMMAND_LINE))
    if rest:
        to = getattr(flags[rest_into], "passes_to", None)
        if to:
            refuse_unknown(parser, rest, to())
        before = getattr(args, rest_into)
        setattr(args, rest_into, merged_flags(before, rest, to()) if to else [*before, *rest])
        sources[rest_into] = (COMMAND_LINE if sources[rest_into] in (DEFAULT, COMMAND_LINE) else
                              f"{sources[rest_into]}, then the command line")
    missing = [action for action in required if sources[action.dest] == DEFAULT]
    if args.print_config:  # the settings so far, the required ones not given among them
        if os.environ.get("RANK", "0") == "0":  # once under a launcher: a file to keep
            sources.update({action.dest: REQUIRED for action in missing})
            print(settings_text(parser.prog, flags, args, sources, unset(args) if unset else {},
                                arguments_text(parser, args)), end="")
        raise SystemExit(0)
    if missing:
        parser.error("the following arguments are required: "
                     + ", ".join("/".join(action.option_strings) for action in missing)
                     + " (on the command line or in the --config file)")
    return args, sources


def refuse_unknown(parser: argparse.ArgumentParser, tokens: list,
                   to: argparse.ArgumentParser) -> None:
    """parser.error for the flags of `tokens`, handed on to the command `to` parses, that
    neither command has, with the closest of both's flags (a typo of the first's is not the
    second's error)."""
    unknown = [group[0].split("=", 1)[0] for action, group in flag_groups(tokens, to)
               if action is None and group[0].startswith("-") and not number(group[0])]
    if unknown:
        names = [option for command in (parser, to) for option in command._option_string_actions
                 if option.startswith("--")]
        hints = [f"; {name}: {hint}" for name in unknown if (hint := instead(to, name, name,
                                                                              names))]
        parser.error(f"{' '.join(unknown)}: not a flag of {parser.prog} nor of {to.prog}"
                     + "".join(hints))


def command_line_flags(parser: argparse.ArgumentParser, argv: list) -> set:
    """The dests of the flags `argv` gives. A setting given under two of its names (`--seq-len 32
    --seq-length 128`, Megatron-LM's name beside ours) is an error, as in a --config file:
    argparse would keep the last."""
    names = {option: action for action in parser._actions for option in action.option_strings
             if option.startswith("--")}
    first = {}
    for argument in argv:
        if argument == "--":
            break
        option = argument.split("=", 1)[0]
        if option in names and first.setdefault(names[option].dest, option) != option:
            parser.error(f"{first[names[option].dest]} and {option} are one setting: give it "
                         "once")
    return set(first)


def config_file(parser: argparse.ArgumentParser, argv: list) -> Optional[str]:
    """The --config FILE of argv (None: none), before the parser reads the rest."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append")
    paths = pre.parse_known_args(argv)[0].config or []
    if len(paths) > 1:
        parser.error(f"--config {' --config '.join(paths)}: give one file (a flag on the "
                     "command line changes what it says)")
    if paths == [""]:
        parser.error("--config: give a file")
    return paths[0] if paths else None


def parse_over(parser, defaults: dict, layers: list, argv: list, known: bool) -> tuple:
    """(argv parsed over the layers' values as defaults, the last layer winning over the first;
    the arguments the parser does not know: with `known`, kept, else an error)."""
    parser.set_defaults(**defaults)
    for _, values in layers:
        parser.set_defaults(**values)
    return parser.parse_known_args(argv) if known else (parser.parse_args(argv), [])


def read_config(parser, flags: dict, path: str) -> dict:
    """{dest: value} of the TOML file `path`, each value checked by its flag."""
    try:
        regular_file(path)  # a FIFO would hang the command, /dev/zero fill its memory
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            parser.error(f"--config {path}: {os.path.getsize(path):,} bytes; a settings file is "
                         f"a few hundred")
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except NotRegularFile:
        parser.error(f"--config {path}: {file_kind(os.stat(path).st_mode)}, not a file: give a "
                     "TOML file of settings")
    except OSError as error:
        parser.error(f"--config {path}: cannot read it ({error.strerror})")
    except UnicodeDecodeError:
        parser.error(f"--config {path}: not UTF-8 text; save it as UTF-8 (TOML's encoding)")
    except tomllib.TOMLDecodeError as error:
        bom = "; it starts with a byte-order mark: save it as UTF-8 without one" if open(
            path, "rb").read(3) == b"\xef\xbb\xbf" else ""
        parser.error(f"--config {path}: not TOML ({error}){bom}")
    by_name = {option[2:]: action for action in flags.values()
               for option in action.option_strings if option.startswith("--")}
    values, folder = {}, os.path.dirname(os.path.abspath(path))
    for key, value in table.items():
        action = by_name.get(key) or by_name.get(key.replace("_", "-"))
        if action is None and key.replace("_", "-") in COMMAND_LINE_ONLY:
            parser.error(f"--config {path}: {key} is given on the command line only (--"
                         f"{key.replace('_', '-')}"
                         + ("; or TUPE_DS_VERBOSE=1 in the environment, which the command reads "
                            "as it starts, before the file" if "verbose" in key else "") + ")")
        if action is None:
            hint = instead(parser, "--" + key, key, list(by_name))
            parser.error(f"--config {path}: {key} is not a setting of {parser.prog} (keys are "
                         f"its flags without the dashes: {parser.prog} --help)"
                         + (f"; {hint}" if hint else ""))
        if action.dest in values:
            parser.error(f"--config {path}: {key} sets {action.option_strings[0]} a second time "
                         "(under another of its names)")
        try:
            if hasattr(action, "path_kind"):
                value = relative_to(folder, value, action.path_kind, expand=True)
            elif hasattr(action, "passes_to") and isinstance(value, list):
                if odd := [item for item in value if not isinstance(item, (str, int, float))
                           or isinstance(item, bool)]:
                    raise ValueError(f"{odd[0]!r}: give each flag and each value as a string "
                                     '(["--bf16", "--seq-len", "128"])')
                value = passed_flags(folder, [str(item) for item in value], action.passes_to(),
                                     expand=True)
        except ValueError as error:
            parser.error(f"--config {path}: {key} = {error}")
        try:
            values[action.dest] = flag_value(parser, action, f"--config {path}: {key}", value)
        except ValueError as error:
            parser.error(str(error))
    return values


def checked_layer(parser, flags: dict, where: str, values: dict) -> dict:
    """A recorded layer's values, each checked as a file's are; a setting the parser no longer
    has is said and left out."""
    checked, problems, fixes = {}, [], []
    for dest, value in values.items():
        if dest not in flags:
            logger.warning(f"{parser.prog}: {where} records {dest}, no setting of this version: "
                           "ignored")
            continue
        if isinstance(value, list) and flags[dest].nargs is None:  # typed "A,B" (--mask-split)
            value = ",".join(map(str, value))
        try:
            checked[dest] = flag_value(parser, flags[dest], f"{where}: {dest}", value)
        except ValueError as error:  # each said: a run that records several learns all at once
            action = flags[dest]
            problems.append(str(error))
            fixes.append(action.option_strings[0] if action.nargs != 0 else
                         f"{action.option_strings[0][2:]} = true or false in a --config file")
    if problems:
        parser.error(f"{'; '.join(problems)}; give {', '.join(fixes)} to set "
                     f"{'it' if len(fixes) == 1 else 'them'} anew")
    return checked


def flag_value(parser, action: argparse.Action, where: str, value):
    """`value` from a file, converted and checked as argparse would the flag's strings;
    ValueError saying why not."""
    if value is None:  # a setting the run recorded unset (TOML has no null)
        return None
    if action.nargs == 0:  # store_true, store_false
        if not isinstance(value, bool) or not isinstance(action.const, bool):
            raise ValueError(f"{where} = {value!r}: give true or false")
        return action.const if value else not action.const
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if isinstance(value, dict) or (isinstance(value, list) and not many):
        typed = (f" (this flag takes several in one: \"{joined(action, value)}\")"
                 if isinstance(value, list) and action.type is not None else "")
        raise ValueError(f"{where} = {value!r}: give one value{typed}")
    items = value if isinstance(value, list) else [value]
    if many and not items and action.nargs == "+":
        raise ValueError(f"{where}: give at least one value")
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        raise ValueError(f"{where} = {value!r}: give {action.nargs} values")
    converted = [converted_item(action, where, item) for item in items]
    stored = argparse.Namespace()  # what the flag's action keeps of them (a custom one too)
    try:
        action(parser, stored, converted if many else converted[0])
    except argparse.ArgumentError as error:
        raise ValueError(f"{where} = {value!r}: {error.message}")
    return getattr(stored, action.dest)


def converted_item(action: argparse.Action, where: str, item):
    if isinstance(item, (bool, dict, list)):
        raise ValueError(f"{where}: {item!r} is not a value of this flag")
    text = str(item)
    try:
        value = action.type(text) if action.type else text
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"{where} = {item!r}: {error}") from None
    except (ValueError, TypeError):  # as argparse says it
        raise ValueError(f"{where} = {item!r}: invalid "
                         f"{getattr(action.type, '__name__', '')} value") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} = {item!r}: choose one of "
                         f"{', '.join(map(str, action.choices))}")
    return value


def settings_text(prog: str, flags: dict, args: argparse.Namespace, sources: dict,
                  elsewhere: dict, arguments: list = ()) -> str:
    """The settings as a TOML file for --config, each line saying where its value came from; a
    setting with no value is a comment; then the `arguments` lines, and the environment's."""
    lines = [f"# {prog}: the resolved settings, each with where it came from"]
    for dest, action in flags.items():
        name = action.option_strings[0].lstrip("-")
        value = getattr(args, dest)
        where = comment_text(sources[dest])
        if hasattr(action, "path_kind"):  # the file read from any folder
            value = relative_to(os.getcwd(), value, action.path_kind)
        elif hasattr(action, "passes_to") and value:
            value = passed_flags(os.getcwd(), value, action.passes_to())
        if isinstance(value, (list, tuple)) and not value and action.nargs == "+":  # none given
            value = None
        if value is None and dest in elsewhere:
            given, place = elsewhere[dest]
            lines.append(f"# {name} = {toml_value(given)}  # not set: {comment_text(place)}")
        elif value is None:
            lines.append(f"# {name} = (not set)  # {where}")
        else:
            if isinstance(value, tuple) and action.nargs is None:  # typed "A,B" (--mask-split)
                value = joined(action, value)
            try:
                lines.append(f"{name} = {toml_value(value)}  # {where}".encode().decode())
            except UnicodeEncodeError:  # a name of bytes that are no UTF-8 (surrogate escapes)
                lines.append(f"# {name} = (bytes that are not UTF-8 text, which TOML cannot hold: "
                             f"give it on the command line)  # {where}")
    lines += arguments
    lines.append("# the environment's settings, as this command uses them (export them: they are "
                 "no keys of a --config file)")
    lines += [f"# {name} = {toml_value(value)}  # {comment_text(where)} ({what})"
              for name, value, where, what in settings.used()]
    return "\n".join(lines) + "\n"


def arguments_text(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """Lines of the positional arguments as given, as comments: no keys of a --config file."""
    return [f"# {action.dest} = {comment_text(toml_value(getattr(args, action.dest)))}  # "
            "command line (an "
            "argument: no key of a --config file)" if getattr(args, action.dest) not in
            (None, []) else f"# {action.dest} = (not given)  # an argument of the command line"
            for action in parser._actions if not action.option_strings]


def joined(action: argparse.Action, values) -> str:
    """The one string a flag whose type makes several values of it is typed as: "A,B", or
    with the flag's own separator (`action.joined_by`: tupe-prep's --shard I/N)."""
    return getattr(action, "joined_by", ",").join(map(str, values))


def comment_text(text: str) -> str:
    """`text` as a TOML comment holds it: a control character or a byte that is no UTF-8 (a
    surrogate escape) written as its escape."""
    return re.sub(r"[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]", lambda m: ascii(m.group())[1:-1], text)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    # its escapes are TOML's too; TOML also escapes DEL, which JSON leaves as it is
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
