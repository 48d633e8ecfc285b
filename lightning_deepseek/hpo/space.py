"""Search spaces in Hydra's sweep syntax, turned into Optuna distributions.

Supported, with the same meaning as Hydra's basic sweeper:

- ``choice(a, b, ...)`` and the shorthand ``a,b,c``: categorical;
- ``range(start, stop[, step])``: ordered integers (or floats) with Python's exclusive ``stop``; kept ordinal
  (``IntDistribution``/``FloatDistribution`` with ``step``) so TPE, GP and CMA-ES can use the order;
- ``interval(low, high)``: continuous floats (integers when both ends are written as integers);
- ``tag(log, interval(low, high))`` / ``tag(log, range(...))``: the same on a log scale.

Not supported: ``glob(...)``, ``shuffle(...)``, nested lists as choices. Every error names the parameter and
the bad string, and says how to write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.errors import HydraException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

SYNTAX_HELP = ("write choice(a,b,...), range(start,stop,step), interval(low,high) or "
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


def _range(name: str, sweep: RangeSweep, log: bool) -> BaseDistribution:
    if sweep.shuffle:
        raise SearchSpaceError(f"search space {name}: shuffle(range(...)) is meaningless for a sampler; drop shuffle.")
    start, stop, step = sweep.start, sweep.stop, sweep.step
    if step is None or step <= 0 or stop <= start:
        raise SearchSpaceError(f"search space {name}: range({start}, {stop}, {step}) is empty or descending; "
                               "write range(start, stop, step) with start < stop and step > 0.")
    count = int((stop - start - 1e-12) // step) + 1  # Python's exclusive stop
    last = start + (count - 1) * step
    if all(isinstance(x, int) for x in (start, stop, step)):
        if log and step != 1:
            raise SearchSpaceError(f"search space {name}: tag(log, range(...)) needs step 1 (Optuna's rule).")
        return IntDistribution(start, last, log=log, step=1 if log else step)
    if log:
        raise SearchSpaceError(f"search space {name}: tag(log, range(...)) needs integers; "
                               "use tag(log, interval(low, high)) for floats.")
    return FloatDistribution(float(start), float(last), step=float(step))


def _interval(name: str, sweep: IntervalSweep, log: bool, text: str) -> BaseDistribution:
    low, high = sweep.start, sweep.end
    if low is None or high is None or not low < high:
        raise SearchSpaceError(f"search space {name}: interval({low}, {high}) needs low < high.")
    if log and low <= 0:
        raise SearchSpaceError(f"search space {name}: tag(log, interval({low}, {high})) needs low > 0.")
    # Hydra stores interval ends as floats; written integers ("interval(1, 8)") mean an integer parameter.
    inner = text.split("interval", 1)[1]
    if "." not in inner and "e" not in inner.lower() and low == int(low) and high == int(high):
        return IntDistribution(int(low), int(high), log=log)
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
        return _range(name, value, log)
    if isinstance(value, IntervalSweep):
        return _interval(name, value, log, override.input_line or "")
    raise SearchSpaceError(f"search space {name}: {override.input_line!r} is not supported here (glob and "
                           f"lists are not search spaces); {SYNTAX_HELP}.")


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
    lines = [f"{name}={_as_override_value(value)}" for name, value in (params or {}).items()]
    entries = parse_overrides(lines, field=field) + parse_overrides(overrides or [])
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
