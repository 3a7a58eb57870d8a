"""The metrics the paper reports per GLUE task, on numpy arrays of predictions and labels.

Accuracy, F1 and Matthews are written here (a few lines each) so that fine-tuning needs no
scikit-learn; the correlations are scipy's. The tests check them against both.
"""

import numpy as np
import scipy.stats


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


def undefined_correlation(predicted: np.ndarray, labels: np.ndarray) -> bool:
    """Fewer than 2 examples, or constant predictions or labels: their correlation is taken as 0
    (not scipy's NaN, as a model predicting one score has none)."""
    if len(predicted) < 2:
        return True
    return bool(np.all(predicted == predicted[0]) or np.all(labels == labels[0]))


def pearson(predicted: np.ndarray, labels: np.ndarray) -> float:
    if undefined_correlation(predicted, labels):
        return 0.0
    return float(scipy.stats.pearsonr(predicted, labels).statistic)


def spearman(predicted: np.ndarray, labels: np.ndarray) -> float:
    if undefined_correlation(predicted, labels):
        return 0.0
    return float(scipy.stats.spearmanr(predicted, labels).statistic)


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson,
           "spearman": spearman}
