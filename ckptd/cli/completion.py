"""`ckptd completion bash|zsh|fish`: a shell completion script generated from the argument
parser itself (its commands, options, choices and help), so it never drifts from it. Writes
nothing anywhere; the user sources or installs what it prints."""

from __future__ import annotations

import argparse
import shlex

_FILE_OPTIONS = ("--socket", "--config", "--to", "--unit", "--path")  # options that take a path


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """What may follow a command: its options, its positionals' choices, its sub-commands."""
    words = [s for a in _options(parser) for s in a.option_strings if s.startswith("--")]
    for a in parser._actions:
        if not a.option_strings and a.choices and not isinstance(a, argparse._SubParsersAction):
            words += [str(c) for c in a.choices]
    words += list(_commands(parser))
    return sorted(set(words))


def _valued(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each option that takes a value, with its choices (empty: a path or free text)."""
    out: dict[str, list[str]] = {}
    for sub in (parser, *_commands(parser).values()):
        for a in _options(sub):
            if a.nargs not in (0, "?"):  # "?": the value may be left out (status --watch)
                for s in a.option_strings:
                    out[s] = [str(c) for c in a.choices or []]
    return out


def bash(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    valued = _valued(parser)
    skip = "|".join(sorted(valued))
    lines = ["# ckptd completion for bash: source <(ckptd completion bash)",
             "_ckptd() {",
             '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
             '    local cmd="" i',
             "    for ((i = 1; i < COMP_CWORD; i++)); do",
             '        case "${COMP_WORDS[i]}" in',
             f"            {skip}) ((i++)) ;;",
             "            -*) ;;",
             '            *) cmd="${COMP_WORDS[i]}"; break ;;',
             "        esac",
             "    done",
             '    case "$prev" in']
    for opt, choices in sorted(valued.items()):
        if choices:
            lines.append(f'        {opt}) COMPREPLY=($(compgen -W {shlex.quote(" ".join(choices))}'
                         ' -- "$cur")); return ;;')
        elif opt in _FILE_OPTIONS:
            lines.append(f'        {opt}) COMPREPLY=($(compgen -f -- "$cur")); return ;;')
        else:
            lines.append(f"        {opt}) COMPREPLY=(); return ;;")
    lines += ["    esac", '    case "$cmd" in']
    top = " ".join(sorted(set(_words(parser)) - {"--version"}) + ["--version"])
    lines.append(f'        "") COMPREPLY=($(compgen -W {shlex.quote(top)} -- "$cur")) ;;')
    for name, sub in commands.items():
        lines.append(f"        {name}) COMPREPLY=($(compgen -W"
                     f' {shlex.quote(" ".join(_words(sub)))} -- "$cur")) ;;')
    lines += ["    esac", "}", "complete -o default -F _ckptd ckptd", ""]
    return "\n".join(lines)


def zsh(parser: argparse.ArgumentParser) -> str:
    """zsh runs the bash function through its bashcompinit layer: one script to keep true."""
    return ("#compdef ckptd\n# ckptd completion for zsh: ckptd completion zsh >"
            ' "${fpath[1]}/_ckptd", or source <(ckptd completion zsh)\n'
            "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser))


def fish(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    helps = _help(parser)
    names = " ".join(commands)
    out = ["# ckptd completion for fish: ckptd completion fish >"
           " ~/.config/fish/completions/ckptd.fish", "complete -c ckptd -f"]
    for name in commands:
        out.append(f"complete -c ckptd -n 'not __fish_seen_subcommand_from {names}'"
                   f" -a {name} -d {shlex.quote(helps.get(name, ''))}")
    for name, sub in {"": parser, **commands}.items():
        cond = (f"__fish_seen_subcommand_from {name}" if name
                else f"not __fish_seen_subcommand_from {names}")
        for a in _options(sub):
            for s in a.option_strings:
                if not s.startswith("--") or s == "--help":
                    continue
                arg = ""
                if a.nargs != 0:
                    arg = (f" -r -a {shlex.quote(' '.join(str(c) for c in a.choices))}"
                           if a.choices else " -r -F" if s in _FILE_OPTIONS else " -r")
                desc = (a.help or "").replace("%(default)s", str(a.default))
                out.append(f"complete -c ckptd -n {shlex.quote(cond)} -l {s[2:]}{arg}"
                           f" -d {shlex.quote(desc[:80])}")
        for a in sub._actions:
            if (name and not a.option_strings and a.choices
                    and not isinstance(a, argparse._SubParsersAction)):
                out.append(f"complete -c ckptd -n {shlex.quote(cond)}"
                           f" -a {shlex.quote(' '.join(str(c) for c in a.choices))}")
        for child in _commands(sub) if name else []:
            out.append(f"complete -c ckptd -n {shlex.quote(cond)} -a {child}")
    return "\n".join(out) + "\n"


SHELLS = {"bash": bash, "zsh": zsh, "fish": fish}


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `shell` (bash, zsh or fish)."""
    return SHELLS[shell](parser)
