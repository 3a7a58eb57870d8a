"""The metrics the paper reports per GLUE task, on numpy arrays of predictions and labels.

Written here (a few lines each) so that fine-tuning needs neither scikit-learn nor scipy; the
tests check them against both.
"""

import numpy as np


def accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
    return float((predicted == labels).mean())


def f1(predicted: np.ndarray, labels: np.ndarray) -> float:
    """F1 of the positive class (label 1), as GLUE reports it for MRPC and QQP."""
    true_positive = np.sum((predicted == 1) & (labels == 1))
    predicted_positive, actual_positive = np.sum(predicted == 1), np.sum(labels == 1)
    if predicted_positive + actual_positive == 0:
        return 0.0
    return float(2 * true_positive / (predicted_positive + actual_positive))


def matthews(predicted: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation of binary predictions (CoLA); 0 when a class is never predicted."""
    tp = np.sum((predicted == 1) & (labels == 1), dtype=np.float64)
    tn = np.sum((predicted == 0) & (labels == 0), dtype=np.float64)
    fp = np.sum((predicted == 1) & (labels == 0), dtype=np.float64)
    fn = np.sum((predicted == 0) & (labels == 1), dtype=np.float64)
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(predicted: np.ndarray, labels: np.ndarray) -> float:
    x, y = predicted - predicted.mean(), labels - labels.mean()
    denominator = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denominator) if denominator else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    unique, inverse = np.unique(values, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def spearman(predicted: np.ndarray, labels: np.ndarray) -> float:
    return pearson(_ranks(predicted), _ranks(labels))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson,
           "spearman": spearman}
