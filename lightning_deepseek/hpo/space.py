"""Search spaces in Hydra's sweep syntax, turned into Optuna distributions as hydra-optuna-sweeper does.

A config written for hydra-optuna-sweeper searches the same space here:

- ``choice(a, b, ...)``, the shorthand ``a,b,c`` and ``shuffle(choice(...))``: categorical;
- ``range(start, stop[, step])``: ordered integers (floats if any bound or the step is a float) from ``start`` to
  ``stop`` **inclusive** (hydra-optuna-sweeper's meaning, unlike Hydra's basic sweeper), kept ordinal so TPE,
  GP and CMA-ES can use the order; a ``stop`` off the step grid is lowered onto it (as Optuna would, silently);
- ``shuffle(range(...))``: categorical over Hydra's own range, which **excludes** ``stop`` (upstream's meaning
  too: the one inconsistency of upstream that we keep, and :func:`upstream_notes` warns about at sweep start);
- ``interval(low, high)``: floats, even for integer ends (Hydra stores them as floats);
  ``int(interval(low, high))``: integers;
- ``tag(log, interval(...))``, ``tag(log, int(interval(...)))``: the same on a log scale;
  ``tag(log, range(...))`` (integers, step 1) is log-scaled too, where upstream drops the tag silently.

Also hydra-optuna-sweeper's deprecated ``search_space`` entries (``{type: int|float|categorical, low, high,
step, log, choices}``): :func:`distribution_from_config`. Not supported: ``glob(...)``, nested lists as choices.
Every error names the parameter and the bad string, and says how to write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.errors import HydraException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

SYNTAX_HELP = ("write choice(a,b,...), range(start,stop,step), interval(low,high), int(interval(low,high)) or "
               "tag(log, interval(low,high)), for example 'tag(log, interval(1e-4, 1e-2))'")


class SearchSpaceError(ValueError):
    """A malformed or unsupported search-space entry; the message names the parameter and the fix."""


def parse_overrides(overrides: list[str], field: str = "override") -> list[Override]:
    """Parse ``key=value`` strings with Hydra's grammar; a syntax error names ``field`` and the string."""
    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:
            detail = " ".join(str(exc).split())
            raise SearchSpaceError(f"{field}: cannot parse {text!r} ({detail}); {SYNTAX_HELP}.") from None
    return parsed


def _categorical(name: str, values: list[Any]) -> CategoricalDistribution:
    for value in values:
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise SearchSpaceError(f"search space {name}: choice value {value!r} is a {type(value).__name__}; "
                                   "choices must be numbers, strings, booleans or null.")
    return CategoricalDistribution(values)


def _range(name: str, override: Override, log: bool) -> BaseDistribution:
    sweep = override.value()
    start, stop, step = sweep.start, sweep.stop, sweep.step
    if step is None or step <= 0 or stop < start:
        raise SearchSpaceError(f"search space {name}: range({start}, {stop}, {step}) is empty or descending; "
                               "write range(start, stop, step) with start <= stop and step > 0.")
    if sweep.shuffle:  # upstream: the values of Hydra's range (stop excluded), in any order
        return _categorical(name, list(override.sweep_iterator()))
    count = int((stop - start) / step + 1e-9) + 1  # stop included (hydra-optuna-sweeper's meaning)
    if all(isinstance(x, int) for x in (start, stop, step)):
        if log and step != 1:
            raise SearchSpaceError(f"search space {name}: tag(log, range(...)) needs step 1 (Optuna's rule).")
        return IntDistribution(start, start + (count - 1) * step, log=log, step=step)
    if log:
        raise SearchSpaceError(f"search space {name}: tag(log, range(...)) needs integers; "
                               "use tag(log, interval(low, high)) for floats.")
    return FloatDistribution(float(start), float(start + (count - 1) * step), step=float(step))


def _interval(name: str, sweep: IntervalSweep, log: bool) -> BaseDistribution:
    low, high = sweep.start, sweep.end
    if low is None or high is None or not low < high:
        raise SearchSpaceError(f"search space {name}: interval({low}, {high}) needs low < high.")
    if log and low <= 0:
        raise SearchSpaceError(f"search space {name}: tag(log, interval({low}, {high})) needs low > 0.")
    # Hydra stores interval ends as floats; only int(interval(...)) keeps them integers (as upstream reads it).
    if isinstance(low, int) and isinstance(high, int):
        return IntDistribution(low, high, log=log)
    return FloatDistribution(float(low), float(high), log=log)


def distribution_of(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override (``key=choice(...)``, ``key=range(...)``, ...)."""
    name, value = override.get_key_element(), override.value()
    tags = set(getattr(value, "tags", ()) or ())
    unknown = tags - {"log"}
    if unknown:
        raise SearchSpaceError(f"search space {name}: unknown tag(s) {sorted(unknown)}; the only tag is `log`, "
                               "as in tag(log, interval(1e-4, 1e-1)).")
    log = "log" in tags
    if isinstance(value, ChoiceSweep):
        if log:
            raise SearchSpaceError(f"search space {name}: tag(log, ...) applies to interval or range, not choice.")
        return _categorical(name, list(value.list))
    if isinstance(value, RangeSweep):
        return _range(name, override, log)
    if isinstance(value, IntervalSweep):
        return _interval(name, value, log)
    raise SearchSpaceError(f"search space {name}: {override.input_line!r} is not supported here (glob and "
                           f"lists are not search spaces); {SYNTAX_HELP}.")


def distribution_from_config(name: str, node: Mapping[str, Any]) -> BaseDistribution:
    """A hydra-optuna-sweeper ``search_space`` entry (``{type, low, high, step, log, choices}``) as a distribution."""
    kind = str(getattr(node.get("type"), "name", node.get("type")))
    low, high, step, log = node.get("low"), node.get("high"), node.get("step"), bool(node.get("log", False))
    if kind == "categorical" and node.get("choices"):
        return _categorical(name, list(node["choices"]))
    if kind in ("int", "float") and low is not None and high is not None:
        if kind == "int":
            return IntDistribution(int(low), int(high), log=log, step=1 if log or step is None else int(step))
        return FloatDistribution(float(low), float(high), log=log, step=None if log or step is None else float(step))
    raise SearchSpaceError(f"hydra.sweeper.search_space.{name}={dict(node)!r}: needs type: int|float with low and "
                           "high, or type: categorical with choices; better, write it in hydra.sweeper.params as "
                           "'int(interval(low, high))', 'interval(low, high)' or 'choice(a, b)'.")


def upstream_notes(overrides: list[Override], grid: bool) -> list[str]:
    """Where these sweep overrides mean something that hydra-optuna-sweeper itself is inconsistent about."""
    notes = []
    for override in overrides:
        value, name = override.value(), override.get_key_element()
        if isinstance(value, RangeSweep) and value.shuffle:
            notes.append(f"{name}: shuffle(range(...)) is a choice over Hydra's range, which excludes stop, while "
                         "range(...) without shuffle includes stop (both as hydra-optuna-sweeper reads them)")
        elif isinstance(value, RangeSweep) and grid:
            notes.append(f"{name}: with the grid sampler, range(...) includes stop here as it does for every other "
                         "sampler; hydra-optuna-sweeper's grid leaves stop out")
        elif isinstance(value, RangeSweep) and "log" in (value.tags or ()):
            notes.append(f"{name}: tag(log, range(...)) samples on a log scale; hydra-optuna-sweeper ignores the tag")
    return notes


def build_space(params: Mapping[str, Any] | None, overrides: list[str] | None = None,
                field: str = "hydra.sweeper.params") -> tuple[dict[str, BaseDistribution], list[str]]:
    """Split a ``params:`` block and command-line overrides into a search space and fixed overrides.

    Args:
        params: ``name -> "choice(...)" | "interval(...)" | ... | fixed value`` (the sweeper's ``params:``).
        overrides: command-line overrides; sweep ones join the space, the rest stay fixed. They win over
            ``params`` for the same name.
        field: how errors name where ``params`` came from (the sweeper's ``hydra.sweeper.params``, or
            ``search(space=...)``).

    Returns:
        ``(space, fixed)``: name -> distribution, and the non-sweep overrides to pass to every job.
    """
    entries = parse_space(params, overrides, field)
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    names: dict[str, str] = {}  # key -> name with its +/++ prefix, so a later entry replaces an earlier one
    for override in entries:
        key = override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"
        space.pop(names.get(key, key), None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            names[key] = override.get_key_element()
            space[names[key]] = distribution_of(override)
        else:
            fixed[key] = override.input_line
    return space, list(fixed.values())


def parse_space(params: Mapping[str, Any] | None, overrides: list[str] | None = None,
                field: str = "hydra.sweeper.params") -> list[Override]:
    """The ``params:`` block then the command-line overrides, parsed (see :func:`build_space`)."""
    lines = [f"{name}={_as_override_value(value)}" for name, value in (params or {}).items()]
    return parse_overrides(lines, field=field) + parse_overrides(overrides or [])


def _as_override_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_override_value(v) for v in value)
    return repr(value)


def suggest(trial: optuna.Trial, space: Mapping[str, BaseDistribution]) -> dict[str, Any]:
    """Ask ``trial`` for a value of every parameter in ``space``."""
    params: dict[str, Any] = {}
    for name, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            params[name] = trial.suggest_categorical(name, dist.choices)
        elif isinstance(dist, IntDistribution):
            params[name] = trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, FloatDistribution):
            params[name] = trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
        else:
            raise SearchSpaceError(f"search space {name}: unsupported distribution {dist!r}.")
    return params


def to_overrides(params: Mapping[str, Any]) -> list[str]:
    """Hydra overrides (``key=value``) for sampled parameters, quoting strings that need it."""
    return [f"{name}={_quote(value)}" for name, value in params.items()]


def _quote(value: Any) -> str:
    if isinstance(value, str):
        plain = value.replace("_", "").replace("-", "").replace(".", "").replace("/", "")
        if plain.isalnum():
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    return repr(value)


def grid_of(space: Mapping[str, BaseDistribution]) -> dict[str, list[Any]]:
    """Every value of a finite space (for ``GridSampler``); intervals have none, so they are an error."""
    grid: dict[str, list[Any]] = {}
    for name, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            grid[name] = list(dist.choices)
        elif isinstance(dist, (IntDistribution, FloatDistribution)) and dist.step is not None and not dist.log:
            count = int(round((dist.high - dist.low) / dist.step)) + 1
            grid[name] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise SearchSpaceError(f"sampler GridSampler: parameter {name} is continuous ({dist}); a grid needs "
                                   "choice(...) or range(...) for every parameter.")
    return grid
