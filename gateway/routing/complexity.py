"""The complexity scorer: request body -> features -> logistic score in [0, 1] that the request is complex."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gateway.routing.features import FEATURE_NAMES, FeatureExtractor, Lexicon

DEFAULT_MODEL_PATH = Path(__file__).parent / "data" / "complexity_model.json"


@dataclass(frozen=True)
class ComplexityResult:
    """A score with the raw features and each feature's share of the logit (for `route explain`)."""

    score: float  # in [0, 1]
    features: dict[str, float]  # raw feature values
    contributions: dict[str, float]  # weight * scaled value, summed with `bias` into the logit
    bias: float = 0.0

    @property
    def logit(self) -> float:
        """bias + sum of contributions."""
        return self.bias + math.fsum(self.contributions.values())


@dataclass(frozen=True)
class ComplexityModel:
    """Learned logistic-regression weights over FEATURE_NAMES; a feature's input is value / scale."""

    feature_names: tuple[str, ...]
    weights: tuple[float, ...]
    scales: tuple[float, ...]
    bias: float
    threshold: float = 0.5
    lexicon_path: Path | None = None  # None: the bundled gateway/routing/data/complexity_lexicons.json

    def __post_init__(self) -> None:
        n = len(self.feature_names)
        if len(self.weights) != n or len(self.scales) != n:
            raise ValueError(
                f"model has {n} features but {len(self.weights)} weights, {len(self.scales)} scales"
            )
        unknown = sorted(set(self.feature_names) - set(FEATURE_NAMES))
        if unknown:
            raise ValueError(f"model names unknown features: {', '.join(unknown)}")
        if any(s <= 0 for s in self.scales):
            raise ValueError("feature scales must be positive")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")

    @classmethod
    def load(cls, path: Path | None = None) -> ComplexityModel:
        """Read a model JSON (default: the committed gateway/routing/data/complexity_model.json).

        A "lexicon" entry names a lexicon file relative to the model file; without one, the bundled lexicon.
        """
        path = path or DEFAULT_MODEL_PATH
        data = json.loads(path.read_text(encoding="utf-8"))
        names = tuple(str(n) for n in data["features"])
        lexicon = data.get("lexicon")
        return cls(
            feature_names=names,
            weights=tuple(float(data["weights"][n]) for n in names),
            scales=tuple(float(data["scales"][n]) for n in names),
            bias=float(data["bias"]),
            threshold=float(data.get("threshold", 0.5)),
            lexicon_path=path.parent / lexicon if isinstance(lexicon, str) else None,
        )

    def to_json(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The JSON document `load` reads; `extra` (training figures) is kept alongside."""
        doc: dict[str, Any] = {
            "features": list(self.feature_names),
            "bias": self.bias,
            "threshold": self.threshold,
            "weights": dict(zip(self.feature_names, self.weights, strict=True)),
            "scales": dict(zip(self.feature_names, self.scales, strict=True)),
        }
        if self.lexicon_path is not None:
            doc["lexicon"] = str(self.lexicon_path)
        doc.update(extra or {})
        return doc

    def with_overrides(self, weights: Mapping[str, float]) -> ComplexityModel:
        """A copy with some weights replaced by feature name (policy overrides); unknown names: ValueError."""
        unknown = sorted(set(weights) - set(self.feature_names))
        if unknown:
            raise ValueError(f"unknown complexity feature(s): {', '.join(unknown)}")
        new = tuple(float(weights.get(n, w)) for n, w in zip(self.feature_names, self.weights, strict=True))
        return replace(self, weights=new)


class ComplexityScorer:
    """Scores OpenAI chat or completions request bodies; deterministic and never raises on odd input."""

    def __init__(self, model: ComplexityModel | None = None) -> None:
        self.model = model or ComplexityModel.load()
        self.extractor = FeatureExtractor(Lexicon.load(self.model.lexicon_path))
        self._terms = tuple(zip(self.model.feature_names, self.model.weights, self.model.scales, strict=True))

    def score(self, body: Mapping[str, Any]) -> ComplexityResult:
        """Features -> logit -> sigmoid."""
        features = self.extractor.extract(body)
        contributions = {name: w * features[name] / s for name, w, s in self._terms}
        logit = self.model.bias + math.fsum(contributions.values())
        score = 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, logit))))
        return ComplexityResult(score, features, contributions, self.model.bias)

    def is_complex(self, body: Mapping[str, Any]) -> bool:
        """Score at or above the model's threshold."""
        return self.score(body).score >= self.model.threshold


def evaluate(
    scorer: ComplexityScorer, rows: Iterable[Mapping[str, Any]], threshold: float = 0.5
) -> dict[str, float]:
    """Accuracy, precision/recall for "complex" and the share routed to the frontier, over labelled rows."""
    tp = fp = tn = fn = 0
    for row in rows:
        predicted = scorer.score(row).score >= threshold
        actual = row.get("label") == "complex"
        tp += predicted and actual
        fp += predicted and not actual
        fn += actual and not predicted
        tn += not predicted and not actual
    n = tp + fp + tn + fn
    return {
        "n": float(n),
        "accuracy": (tp + tn) / n if n else 0.0,
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "frontier_share": (tp + fp) / n if n else 0.0,
    }
