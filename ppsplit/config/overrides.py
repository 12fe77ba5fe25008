"""The command line checked before Hydra composes it, so that every mistake in it gets one line
naming it, with what is allowed (Hydra's own messages run over several lines and exit 1).

What is caught here: an override that does not parse (an unquoted space in a value), a key that
does not exist (with the nearest keys, and the ``+`` that adds a new one), an option of a config
group that does not exist (with the allowed ones), and anything else Hydra refuses while
composing. Values themselves are checked by :mod:`ppsplit.config.spec` once the config is composed.
"""

from __future__ import annotations

import os

from ppsplit.errors import PpsplitError, nearest


def check_command_line(argv: list[str], conf_dir: str, config_name: str = "config", compose: bool = True) -> None:
    """Raise :class:`PpsplitError` if Hydra would refuse to compose ``argv`` (a run or a sweep);
    a command line that only asks Hydra for help, its config or completion is left to Hydra.

    ``compose=False``: only what needs no composition (the overrides parse, every option a sweep
    names exists); a single run's config is then composed once, by Hydra, and what it refuses is
    said by :func:`refusal`. A sweep is composed here first all the same, so that a bad key
    stops it before its folder exists."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # argparse has printed its own usage line
    if (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
            or args.experimental_rerun or args.config_path or args.config_name):
        return
    overrides = list(args.overrides)
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    parsed = _parse(overrides)
    groups = _groups(conf_dir)
    single = []
    for text, override in zip(overrides, parsed):
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else None
        key = override.key_or_group
        if key in groups and values:
            for value in values:  # every option a sweep names must exist
                _check_option(key, value, groups[key])
        single.append(f"{text.split('=', 1)[0]}={values[0]}" if values else text)
    if compose or args.multirun:
        _compose(single, conf_dir, config_name, groups)


def refusal(err: Exception, argv: list[str], conf_dir: str, config_name: str = "config") -> PpsplitError:
    """Hydra's refusal to compose the config of ``argv`` (its exception), said in one line."""
    from hydra._internal.utils import get_args_parser

    overrides = list(get_args_parser().parse_args(argv).overrides)
    try:
        return _said(err, overrides, conf_dir, config_name, _groups(conf_dir))
    except PpsplitError as said:  # an option that does not exist, named with the allowed ones
        return said


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    out = []
    for i, text in enumerate(overrides):
        try:
            out.extend(parser.parse_overrides([text]))
        except OverrideParseException as err:
            before = overrides[i - 1] if i else None
            if "=" not in text and before is not None and "=" in before:
                raise PpsplitError(f"{text!r} is not an override (KEY=VALUE); a value with a space needs "
                                   f"quotes: '{before} {text}'") from None
            if "=" not in text:
                raise PpsplitError(f"{text!r} is not an override; allowed: KEY=VALUE, +KEY=VALUE (a new key) "
                                   "or ~KEY (delete it)") from None
            raise PpsplitError(f"{text!r} does not parse: {_first_line(err)}; values with spaces or "
                               "brackets need quotes, lists are [a,b]") from None
    return out


def _groups(conf_dir: str) -> dict[str, list[str]]:
    """Each config group and its options, from the config folder."""
    out = {}
    for name in sorted(os.listdir(conf_dir)):
        path = os.path.join(conf_dir, name)
        if os.path.isdir(path):
            out[name] = sorted(f[:-5] for f in os.listdir(path) if f.endswith(".yaml"))
    return out


def _check_option(group: str, value: str, options: list[str]) -> None:
    if value not in options and value != "null":
        raise PpsplitError(f"{group}={value} is not known; allowed: {', '.join(options)}"
                           f"{nearest(value, options)}")


def _compose(overrides: list[str], conf_dir: str, config_name: str, groups: dict) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    if GlobalHydra.instance().is_initialized():
        return  # inside a running Hydra app (a test, a notebook): it composes and reports itself
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            compose(config_name=config_name, overrides=overrides)
    except (MissingConfigException, HydraException) as err:
        raise _said(err, overrides, conf_dir, config_name, groups) from None


def _said(err, overrides: list[str], conf_dir: str, config_name: str, groups: dict) -> PpsplitError:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException):
        group, _, value = _missing(err)
        if group in groups:
            _check_option(group, value, groups[group])
        return PpsplitError(f"{_first_line(err)}; allowed config groups: {', '.join(groups)}")
    return PpsplitError(_composition_message(err, overrides, conf_dir, config_name))


def _missing(err) -> tuple[str, str, str]:
    """(group, '/', option) of a 'Could not find GROUP/OPTION' error."""
    text = str(err)
    start = text.find("Could not find '")
    if start < 0:
        return "", "", ""
    path = text[start + len("Could not find '"):].split("'", 1)[0]
    return path.rpartition("/")[0], "/", path.rpartition("/")[2]


def _composition_message(err, overrides: list[str], conf_dir: str, config_name: str) -> str:
    text = str(err)
    if text.startswith("Could not override '"):
        key = text[len("Could not override '"):].split("'", 1)[0]
        given = next((o for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), key)
        value = given.split("=", 1)[1] if "=" in given else ""
        parent = key.rpartition(".")[0]
        keys = _known_keys(conf_dir, config_name, [o for o in overrides if o != given])
        siblings = [k for k in keys if k.rpartition(".")[0] == parent] or keys
        hint = nearest(key, siblings)
        if parent in ("model.config", "model.tp_plan", "launcher.additional_parameters") or not hint:
            where = f"{parent} has no key {key.rpartition('.')[2]!r}" if parent else f"no key {key!r}"
            return f"{key}={value}: {where}{hint}; a new key needs +: +{key}={value}"
        return f"{key}={value}: no such key{hint}"
    if text.startswith("Could not append to config. An item is already at '"):
        key = text.split("'")[1]
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == key), key)
        return f"{given}: {key} exists already; allowed: {given.lstrip('+')} (+ adds only a new key)"
    return _first_line(err)


def _known_keys(conf_dir: str, config_name: str, overrides: list[str]) -> list[str]:
    """Every key of the composed config (dotted), Hydra's own aside."""
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, OmegaConf

    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except Exception:  # the other overrides are wrong too: suggest from the defaults
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(config_name=config_name)
    keys = []

    def walk(node, prefix):
        for k in node.keys():
            path = f"{prefix}{k}"
            keys.append(path)
            child = node._get_node(k)
            if isinstance(child, DictConfig) and not OmegaConf.is_missing(node, k):
                walk(child, path + ".")

    walk(cfg, "")
    return keys


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
