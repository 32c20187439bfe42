"""Weighted sum of plugin scores, and the config file that names the plugins and weights.

A config is ``{"plugins": [{"name": "prefix", "weight": 2}, {"name": "load", "weight": 1}]}``
(JSON or YAML); an entry may carry ``"args"``, keyword arguments for the plugin
(``{"name": "random", "weight": 1, "args": {"seed": 7}}``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import KvmeshError
from kvmesh.routing.plugins import PLUGIN_TYPES, Candidate, RouteRequest, ScorePlugin
from kvmesh.settings.files import settings_text

logger = logging.getLogger(__name__)

DEFAULT_SCORER_CONFIG: dict[str, Any] = {
    "plugins": [
        {"name": "prefix", "weight": 2},
        {"name": "load", "weight": 1},
        {"name": "session", "weight": 1},
    ]
}


class ScorerConfigError(KvmeshError, ValueError):
    """The scorer config names an unknown plugin, has a bad weight or is malformed."""


@dataclass(slots=True, frozen=True)
class Decision:
    """The chosen worker, its weighted total, and every plugin's score of every candidate
    (``per_plugin_scores[plugin][worker_id]``, unweighted)."""

    worker_id: str
    total: float
    per_plugin_scores: dict[str, dict[str, float]]

    def span_attributes(self, prefix: str = "kvmesh.route") -> dict[str, str | float]:
        """Flat attributes for the routing span: the choice, its total, each score."""
        attributes: dict[str, str | float] = {f"{prefix}.worker": self.worker_id, f"{prefix}.score": self.total}
        for plugin, scores in self.per_plugin_scores.items():
            for worker_id, score in scores.items():
                attributes[f"{prefix}.scores.{plugin}.{worker_id}"] = score
        return attributes


class WeightedScorer:
    """Chooses the candidate with the highest ``sum(weight * plugin score)``. Ties go to
    the candidate that comes first in the list given (add a ``random`` plugin with a small
    weight to break ties at random)."""

    def __init__(self, plugins_with_weights: Sequence[tuple[ScorePlugin, float]]) -> None:
        if not plugins_with_weights:
            raise ScorerConfigError("a scorer needs at least one plugin")
        names = [plugin.name for plugin, _ in plugins_with_weights]
        if len(set(names)) != len(names):
            raise ScorerConfigError(f"each plugin may appear once, got {names}")
        for plugin, weight in plugins_with_weights:
            _check_weight(plugin.name, weight)
        self.plugins: list[tuple[ScorePlugin, float]] = [(p, float(w)) for p, w in plugins_with_weights]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError(f"no candidate workers for request {request.request_id}")
        totals = [0.0] * len(candidates)
        per_plugin: dict[str, dict[str, float]] = {}
        for plugin, weight in self.plugins:
            scores = plugin.score(request, candidates)
            assert len(scores) == len(candidates), f"plugin {plugin.name} returned {len(scores)} scores"
            per_plugin[plugin.name] = {c.worker_id: s for c, s in zip(candidates, scores)}
            for i, s in enumerate(scores):
                totals[i] += weight * s
        best = max(range(len(candidates)), key=lambda i: (totals[i], -i))
        return Decision(candidates[best].worker_id, totals[best], per_plugin)

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """Tell the plugins that learn (session affinity) where the request went."""
        for plugin, _ in self.plugins:
            observe = getattr(plugin, "observe", None)
            if observe is not None:
                observe(request, worker_id)


def load_scorer_config(source: str | Path | Mapping[str, Any] | None = None) -> WeightedScorer:
    """A ``WeightedScorer`` from a config dict or a ``.json`` / ``.yaml`` / ``.yml`` file;
    ``None`` gives ``DEFAULT_SCORER_CONFIG``."""
    if source is None:
        config: Any = copy.deepcopy(DEFAULT_SCORER_CONFIG)
    elif isinstance(source, Mapping):
        config = source
    else:
        config = read_scorer_config(source)
    if not isinstance(config, Mapping) or set(config) != {"plugins"}:
        raise ScorerConfigError('a scorer config is a mapping with one key, "plugins"')
    entries = config["plugins"]
    if not isinstance(entries, list) or not entries:
        raise ScorerConfigError('"plugins" must be a non-empty list')
    plugins: list[tuple[ScorePlugin, float]] = []
    for position, entry in enumerate(entries):
        plugins.append(_build_plugin(position, entry))
    scorer = WeightedScorer(plugins)
    logger.info("routing scorer: %s", ", ".join(f"{p.name}={w:g}" for p, w in scorer.plugins))
    return scorer


def read_scorer_config(path: str | Path) -> Any:
    """The parsed content of a ``.json`` / ``.yaml`` / ``.yml`` scorer config file (unchecked)."""
    path = Path(path)
    try:
        text = settings_text(path)
    except OSError as exc:
        raise ScorerConfigError(f"cannot read scorer config {path}: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScorerConfigError(f"{path}: not valid JSON: {exc}") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ScorerConfigError(f"{path}: reading YAML needs the pyyaml package (or use JSON)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScorerConfigError(f"{path}: not valid YAML: {exc}") from None
    raise ScorerConfigError(f"{path}: a scorer config is a .json, .yaml or .yml file")


def _build_plugin(position: int, entry: Any) -> tuple[ScorePlugin, float]:
    where = f"plugins[{position}]"
    if not isinstance(entry, Mapping):
        raise ScorerConfigError(f'{where}: expected a mapping like {{"name": "prefix", "weight": 1}}')
    unknown = set(entry) - {"name", "weight", "args"}
    if unknown:
        raise ScorerConfigError(f"{where}: unknown keys {sorted(unknown)} (allowed: name, weight, args)")
    name = entry.get("name")
    if name not in PLUGIN_TYPES:
        raise ScorerConfigError(f"{where}: unknown plugin {name!r}; known plugins: {', '.join(sorted(PLUGIN_TYPES))}")
    if "weight" not in entry:
        raise ScorerConfigError(f"{where} ({name}): missing weight")
    weight = entry["weight"]
    _check_weight(f"{where} ({name})", weight)
    args = entry.get("args", {})
    if not isinstance(args, Mapping):
        raise ScorerConfigError(f"{where} ({name}): args must be a mapping")
    try:
        plugin = PLUGIN_TYPES[name](**args)
    except (TypeError, ValueError) as exc:
        raise ScorerConfigError(f"{where} ({name}): bad args {dict(args)}: {exc}") from None
    return plugin, float(weight)


def _check_weight(where: str, weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ScorerConfigError(f"{where}: weight must be a positive finite number, got {weight!r}")
