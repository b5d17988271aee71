/* eval_score: one sample's score as torchvision's evaluate() counts it: the training criterion
 * (cross-entropy with label smoothing) and the label's place in the top-k, with torch's tie rule
 * (argmax takes the first of equal maxima). Pure arithmetic in doubles; eval.c's per-sample loop.
 */
#ifndef DDP_WORKER_EVAL_SCORE_H
#define DDP_WORKER_EVAL_SCORE_H

#include <math.h>

/* logits: (classes) fp32; label in [0, classes). torch's cross_entropy(label_smoothing=eps):
 * (1 - eps) (-log p_label) + eps mean_j (-log p_j). */
static inline double eval_score_loss(const float *logits, int classes, int label, double eps) {
    double zmax = logits[0], sum_exp = 0, sum_z = 0;
    for (int j = 1; j < classes; j++)
        zmax = logits[j] > zmax ? logits[j] : zmax;
    for (int j = 0; j < classes; j++) {
        sum_exp += exp(logits[j] - zmax);
        sum_z += logits[j];
    }
    double lse = log(sum_exp) + zmax; /* -log p_j = lse - z_j */
    return (1 - eps) * (lse - logits[label]) + eps * (lse - sum_z / classes);
}

/* How many classes rank before the label: higher scores, and equal ones of a lower index (ties
 * counted as hits made a model of equal logits look perfect); classes when a logit is NaN (it
 * compares false with everything and would pass for a hit). Top-k holds the label when < k. */
static inline int eval_score_rank(const float *logits, int classes, int label) {
    int above = 0;
    for (int j = 0; j < classes; j++) {
        if (isnan(logits[j])) return classes;
        if (logits[j] > logits[label] || (logits[j] == logits[label] && j < label)) above++;
    }
    return above;
}

#endif
