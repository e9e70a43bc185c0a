"""Train the complexity scorer's logistic regression and report honest accuracy figures.

python -m gateway.routing.train [--train gateway/routing/data/routing_train.jsonl]
    [--dev ../shared/data/routing_dev.jsonl] [--out gateway/routing/data/complexity_model.json]

Honest estimate: fit on the authored training set only, score the dev set. Then k-fold CV on dev, and
the committed model, fit on authored + dev rows. Deterministic: no randomness anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.routing.complexity import DEFAULT_MODEL_PATH, ComplexityModel, ComplexityScorer, evaluate
from gateway.routing.features import DEFAULT_LEXICON_PATH, FEATURE_NAMES, FeatureExtractor, Lexicon

Array = npt.NDArray[np.float64]
Row = Mapping[str, Any]

DEFAULT_TRAIN = Path(__file__).parent / "data" / "routing_train.jsonl"
DEFAULT_DEV = Path(__file__).parents[3] / "shared" / "data" / "routing_dev.jsonl"
L2 = 0.02  # on standardized inputs, per row
# Directions we know a priori; the fit may zero such a weight but never flip it.
SIGNS: dict[str, float] = {
    "max_tokens_log2": 1.0,
    "tools": 1.0,
    "requested_words": 1.0,
    "lex_proof_math": 1.0,
    "lex_expert": 1.0,
    "lex_debugging": 1.0,
    "lex_reasoning": 1.0,
    "lex_planning": 1.0,
    "lex_long_output": 1.0,
    "lex_trivial_task": -1.0,
    "lex_brevity": -1.0,
    "lex_greeting": -1.0,
    "lex_lookup": -1.0,
    "lex_definition": -1.0,
    "lex_trivial_code": -1.0,
    "lex_followup": -1.0,
    "short_followup": -1.0,
}
THRESHOLDS = tuple(round(0.30 + 0.025 * i, 3) for i in range(17))  # 0.30 .. 0.70


def load_rows(path: Path) -> list[dict[str, Any]]:
    """JSONL rows with "label" and a request body."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def featurize(rows: Sequence[Row], extractor: FeatureExtractor) -> tuple[Array, Array]:
    """(n, d) raw features in FEATURE_NAMES order and (n,) labels, 1 = complex."""
    x = np.array([[f[n] for n in FEATURE_NAMES] for f in map(extractor.extract, rows)], dtype=np.float64)
    y = np.array([1.0 if r.get("label") == "complex" else 0.0 for r in rows])
    return x, y


def fit_logistic(x: Array, y: Array, l2: float = L2, iters: int = 4000) -> tuple[Array, float, Array]:
    """Class-balanced L2 logistic regression with sign constraints (FISTA); -> weights, bias, scales."""
    scales = np.sqrt(np.mean(x**2, axis=0))
    scales[scales < 1e-6] = 1.0
    z = np.hstack([x / scales, np.ones((len(x), 1))])  # (n, d + 1): the last column is the bias
    sample_w = np.where(y == 1, 0.5 / max(y.sum(), 1), 0.5 / max((1 - y).sum(), 1))
    lower = np.array([0.0 if SIGNS.get(n, 0) > 0 else -np.inf for n in FEATURE_NAMES] + [-np.inf])
    upper = np.array([0.0 if SIGNS.get(n, 0) < 0 else np.inf for n in FEATURE_NAMES] + [np.inf])
    penalty = np.full(z.shape[1], l2)
    penalty[-1] = 0.0
    step = 1.0 / (0.25 * np.linalg.eigvalsh((z * sample_w[:, None]).T @ z).max() + l2)
    theta = np.zeros(z.shape[1])
    momentum, t = theta.copy(), 1.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ momentum, -60, 60)))
        grad = z.T @ (sample_w * (p - y)) + penalty * momentum
        new = np.clip(momentum - step * grad, lower, upper)
        t_next = (1 + np.sqrt(1 + 4 * t * t)) / 2
        momentum = new + (t - 1) / t_next * (new - theta)
        theta, t = new, t_next
    return theta[:-1], float(theta[-1]), scales


def train_model(x: Array, y: Array, threshold: float = 0.5, l2: float = L2) -> ComplexityModel:
    """Fit and wrap as a ComplexityModel over the bundled lexicon."""
    w, b, s = fit_logistic(x, y, l2)
    return ComplexityModel(
        FEATURE_NAMES,
        tuple(round(float(v), 6) for v in w),
        tuple(round(float(v), 6) for v in s),
        round(b, 6),
        threshold,
    )


def predict(model: ComplexityModel, x: Array) -> Array:
    """Scores for a raw feature matrix (same as ComplexityScorer.score, vectorized)."""
    logit = (x / np.array(model.scales)) @ np.array(model.weights) + model.bias
    return np.asarray(1.0 / (1.0 + np.exp(-logit)), dtype=np.float64)


def accuracy(scores: Array, y: Array, threshold: float) -> float:
    """Share of rows whose thresholded score matches the label."""
    return float(np.mean((scores >= threshold) == (y == 1)))


def cross_val_scores(x: Array, y: Array, k: int, l2: float = L2) -> Array:
    """Out-of-fold scores with folds i mod k (rows keep file order: deterministic)."""
    out = np.zeros(len(y))
    fold = np.arange(len(y)) % k
    for f in range(k):
        model = train_model(x[fold != f], y[fold != f], l2=l2)
        out[fold == f] = predict(model, x[fold == f])
    return out


def best_threshold(scores: Array, y: Array) -> float:
    """Threshold with the best accuracy; ties -> the middle of the best plateau."""
    accs = [accuracy(scores, y, t) for t in THRESHOLDS]
    best = [t for t, a in zip(THRESHOLDS, accs, strict=True) if a == max(accs)]
    return best[len(best) // 2]


def main(argv: Sequence[str] | None = None) -> None:
    """Fit, report, write the model JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--train", type=Path, default=DEFAULT_TRAIN)
    parser.add_argument("--dev", type=Path, default=DEFAULT_DEV)
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--l2", type=float, default=L2)
    args = parser.parse_args(argv)
    extractor = FeatureExtractor(Lexicon.load())
    train_rows, dev_rows = load_rows(args.train), load_rows(args.dev)
    x_tr, y_tr = featurize(train_rows, extractor)
    x_dev, y_dev = featurize(dev_rows, extractor)

    honest = train_model(x_tr, y_tr, l2=args.l2)
    dev_scores = predict(honest, x_dev)
    threshold = best_threshold(dev_scores, y_dev)
    figures: dict[str, float] = {
        "honest_dev_accuracy_at_0.5": accuracy(dev_scores, y_dev, 0.5),
        "honest_dev_accuracy": accuracy(dev_scores, y_dev, threshold),
        "train_cv10_accuracy": accuracy(cross_val_scores(x_tr, y_tr, 10, args.l2), y_tr, 0.5),
        "dev_cv10_accuracy": accuracy(cross_val_scores(x_dev, y_dev, 10, args.l2), y_dev, threshold),
        "dev_loo_accuracy": accuracy(cross_val_scores(x_dev, y_dev, len(y_dev), args.l2), y_dev, threshold),
    }
    x_all, y_all = np.vstack([x_tr, x_dev]), np.concatenate([y_tr, y_dev])
    # dev rows held out in turn while the whole authored set stays in training
    fold = np.arange(len(y_dev)) % 10
    oof = np.zeros(len(y_dev))
    for f in range(10):
        keep = np.concatenate([np.ones(len(y_tr), bool), fold != f])
        oof[fold == f] = predict(train_model(x_all[keep], y_all[keep], l2=args.l2), x_dev[fold == f])
    figures["authored_plus_dev_cv10_on_dev_accuracy"] = accuracy(oof, y_dev, threshold)

    final = train_model(x_all, y_all, threshold, args.l2)
    scorer = ComplexityScorer(final)
    figures["final_dev_accuracy_in_sample"] = evaluate(scorer, dev_rows, threshold)["accuracy"]
    figures["final_train_accuracy_in_sample"] = evaluate(scorer, train_rows, threshold)["accuracy"]
    print(f"rows: {len(train_rows)} authored, {len(dev_rows)} dev; threshold {threshold:.3f}")
    for name, value in figures.items():
        print(f"{name:42s} {value:.4f}")
    order = sorted(zip(FEATURE_NAMES, final.weights, strict=True), key=lambda p: -abs(p[1]))
    print("weights: " + ", ".join(f"{n}={w:+.2f}" for n, w in order))
    rounded = {k: round(v, 4) for k, v in figures.items()}
    extra = {
        "lexicon_sha256": hashlib.sha256(DEFAULT_LEXICON_PATH.read_bytes()).hexdigest(),
        "l2": args.l2,
        "rows": {"authored": len(train_rows), "dev": len(dev_rows)},
        "figures": rounded,
    }
    doc = final.to_json(extra)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
