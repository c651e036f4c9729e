/*
 * launch.h - what the forward's (cuda.cu) and the backward's (bwd.cu) host sides both derive from a validated
 * problem when they fill their kernel arguments. Host C++ only; not installed.
 */
#ifndef FLASHC_CUDA_LAUNCH_H
#define FLASHC_CUDA_LAUNCH_H

#include "../internal.h"
#include "../dropout.h"
#include "score.h" /* FC_LOG2E */

#include <stdint.h>

/* 16-byte aligned base and row strides that are multiples of 8 elements (dims of extent 1 never move): rows that
 * cp.async can copy 16 bytes at a time. */
static inline int fc_rows_aligned16(const flashc_tensor *t, int skip_batch) {
    if ((uintptr_t)t->data % 16) return 0;
    for (int d = skip_batch ? 1 : 0; d < 3; d++)
        if (t->shape[d] > 1 && t->stride[d] % 8) return 0;
    return 1;
}

/* A window wider than both lengths is unbounded in effect; clamping keeps the kernels' sums in int32. */
static inline int fc_clamp_window(int64_t w, int64_t limit) { return w < 0 ? -1 : (int)(w < limit ? w : limit); }

/* The score and mask fields that flashc_fwd_args and flashc_bwd_args share (same names), so that the backward
 * forms P exactly as the forward did: scores in base 2 (the scale, or scale / softcap before the tanh, folded
 * into score_mul), the band, ALiBi and the block mask with its block sizes clamped to the lengths. */
template <typename Args>
static inline void fc_set_scores_and_masks(const flashc_problem *p, Args *a) {
    if (p->softcap > 0) {
        a->score_mul = p->scale / p->softcap;
        a->softcap2 = p->softcap * FC_LOG2E;
    } else {
        a->score_mul = p->scale * FC_LOG2E;
        a->softcap2 = 0.f;
    }
    /* With positions the band moves by diag = q_position - k_position: a side is unbounded in effect only past
     * Nq + Nk + |diag| (the front has already made those that hide nothing -1; cuda.cu refuses |diag| > 2^29, so
     * this stays in int32). */
    const int64_t diag = flashc_pos_diag(p);
    const int64_t reach = p->Nq + p->Nk + (diag < 0 ? -diag : diag);
    a->win_left = fc_clamp_window(p->win_left, reach);
    a->win_right = fc_clamp_window(p->win_right, reach);
    a->positions = p->positions;
    a->pos_diag = (int)diag;
    a->alibi = p->alibi, a->alibi_bs = p->alibi_batch_stride;
    if (p->block_mask) {
        a->bm = p->block_mask;
        a->bm_q = (int)(p->bm_q < p->Nq ? p->bm_q : (p->Nq > 0 ? p->Nq : 1));
        a->bm_k = (int)(p->bm_k < p->Nk ? p->bm_k : (p->Nk > 0 ? p->Nk : 1));
        a->bm_batch = (int)p->bm_batch, a->bm_heads = (int)p->bm_heads;
        a->bm_nqb = (int)p->bm_nqb, a->bm_nkb = (int)p->bm_nkb;
    }
}

/* The dropout fields (score.h's FC_DROP_FIELDS) of a problem: the same threshold and factor as every backend's. */
template <typename Args>
static inline void fc_set_dropout(const flashc_problem *p, Args *a) {
    a->dropout = p->dropout_p > 0.0f;
    a->drop_t = a->dropout ? flashc_dropout_threshold(p->dropout_p) : 0u;
    a->drop_scale = a->dropout ? flashc_dropout_scale(p->dropout_p) : 1.0f;
    a->drop_seed = p->dropout_seed, a->drop_offset = p->dropout_offset;
    a->drop_rng = p->dropout_rng;
    /* positions move dropout's (i, j): row0 < 2^32 and k_position / 4 < 2^32, k_position a multiple of 4 (front) */
    a->drop_row0 = a->dropout && p->positions ? (uint32_t)p->q_position : 0u;
    a->drop_col4 = a->dropout && p->positions ? (uint32_t)(p->k_position / 4) : 0u;
}

#endif /* FLASHC_CUDA_LAUNCH_H */
