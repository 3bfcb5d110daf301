/* Fused absorbed-MLA decode attention over latent cache rows, fp32, CPU.
 *
 * For request b with query q[b] [H, D] (D = r + rope: the absorbed query, then the rotated
 * part) and cache rows pool[idx[offs[b] .. offs[b+1])] [n, D]:
 *     s[h, j]  = scale * q[b, h] . row_j
 *     out[b,h] = softmax_j(s[h]) @ row_j[:r]          lse[b, h] = logsumexp_j s[h, j]   (base e)
 *
 * Why a kernel: torch runs this as two products per request (scores, then probs @ rows), each
 * reading the request's rows from memory, plus a Python loop over requests. Here every row is
 * read from memory once. Rows go by in blocks of BLK: a block is scored, and summed into the
 * output with an online softmax (the running max per head; the sums so far rescaled when it
 * grows) while it is still in L1, so the stream of rows from memory never pauses for a second
 * pass. The next rows are prefetched while the current ones are scored.
 *
 * Work items are (request, segment of SEG rows), spread over the OpenMP threads (torch's own
 * libgomp, already loaded in the process). Each item leaves an unnormalised partial (o, m, l);
 * partials of a request merge in segment order. So a request's result is the same bits
 * whatever the batch, the thread count or the scheduling: batching never changes a token.
 *
 * A request with no rows gets out = 0 and lse = -inf (the attention backend contract).
 * Requires D % 16 == 0 and r % 16 == 0 (the caller checks).
 *
 * Rows are stored in one of three layouts (engine/cache/kvformat.py), row_bytes apart:
 *   KIND_F32         D floats;
 *   KIND_FP8         D float8_e4m3fn bytes, value = e4m3 * kv_scale (the layer's scale);
 *   KIND_FP8_DS_MLA  r e4m3 bytes, ceil(r/128) float32 scales (one per 128 latent values),
 *                    D - r bf16 rotary values.
 * FP8 rows are decoded a block of BLK rows at a time into the thread's fp32 buffer (36 KiB at
 * D = 576), scored and summed from there while they are in L1: only the stored bytes come
 * from memory. Decoding is exact up to the one rounding of e4m3 * scale, as torch computes it
 * (KVFormat.decode_latent), so both paths see the same fp32 entries.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define SEG 256 /* rows per work item */
#define BLK 16  /* rows per online-softmax block */
#define V 16    /* floats per vector */

typedef float vf __attribute__((vector_size(V * sizeof(float))));
typedef float vf_unaligned __attribute__((vector_size(V * sizeof(float)), aligned(4), may_alias));

static inline vf ld(const float *p) { return *(const vf_unaligned *)p; }
static inline void st(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf bcast(float x) { return (vf){0} + x; }
static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < V; i++) s += v[i];
    return s;
}

static inline int64_t clamp(int64_t j, int64_t last) { return j < last ? j : last; }

enum { KIND_F32 = 0, KIND_FP8 = 1, KIND_FP8_DS_MLA = 2 };
#define TILE 128 /* fp8_ds_mla: latent values per scale */

typedef uint8_t vu8 __attribute__((vector_size(V)));
typedef uint16_t vu16 __attribute__((vector_size(2 * V)));
typedef int32_t vi __attribute__((vector_size(V * sizeof(int32_t))));
typedef int32_t vi_unaligned __attribute__((vector_size(V * sizeof(int32_t)), aligned(4), may_alias));

static inline vf as_vf(vi x) {
    vf y;
    memcpy(&y, &x, sizeof y);
    return y;
}
static inline vi as_vi(vf x) {
    vi y;
    memcpy(&y, &x, sizeof y);
    return y;
}

/* dst[0..n) = e4m3(src[0..n)) * scale, n % V == 0. With AVX-512: the byte s.eeee.mmm shifted into
 * an fp16 (s.0eeee.mmm0000000) is 2^-8 times the e4m3 value, subnormals included, and the
 * hardware converts fp16 to fp32 exactly; times 256 * scale rounds once. Otherwise: for e > 0
 * the fp32 whose exponent is e + 120 and mantissa m << 20 (2^(e-7) (1 + m/8)); for e == 0
 * (subnormal) m * 2^-9; both exact, and the product with the scale rounds once. Either way the
 * bits of torch's e4m3 -> fp32 cast times the scale. */
static void decode_e4m3(const uint8_t *src, int64_t n, float scale, float *dst) {
#if defined(__AVX512F__)
    const __m256i mag = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
    const __m512 sv = _mm512_set1_ps(256.f * scale);
    for (int64_t k = 0; k < n; k += V) {
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + k)));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, mag), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(x, sign), 8));
        _mm512_storeu_ps(dst + k, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
    }
#else
    const vi mag_mask = (vi){0} + 0x7F, sign_mask = (vi){0} + 0x80, bias = (vi){0} + (120 << 23);
    const vf sub_unit = bcast(1.f / 512.f), sv = bcast(scale);
    for (int64_t k = 0; k < n; k += V) {
        vu8 b;
        memcpy(&b, src + k, sizeof b);
        vi x = __builtin_convertvector(b, vi);
        vi mag = x & mag_mask;
        vi normal = (mag << 20) + bias;
        vi sub = as_vi(__builtin_convertvector(mag, vf) * sub_unit);
        vi is_sub = (mag >> 3) == 0; /* -1 where the exponent field is 0 */
        vi bits = (normal & ~is_sub) | (sub & is_sub) | ((x & sign_mask) << 24);
        st(dst + k, as_vf(bits) * sv);
    }
#endif
}

/* dst[0..n) = bf16(src[0..n)), n % V == 0: the bf16 bits are the top half of the fp32's. */
static void decode_bf16(const uint8_t *src, int64_t n, float *dst) {
    for (int64_t k = 0; k < n; k += V) {
        vu16 h;
        memcpy(&h, src + 2 * k, sizeof h);
        st(dst + k, as_vf(__builtin_convertvector(h, vi) << 16));
    }
}

/* One stored row → D fp32 values. */
static void decode_row(const uint8_t *row, int kind, float kv_scale, int64_t D, int64_t r, float *dst) {
    if (kind == KIND_FP8) {
        decode_e4m3(row, D, kv_scale, dst);
        return;
    }
    int64_t tiles = (r + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++) {
        float s;
        memcpy(&s, row + r + 4 * t, sizeof s);
        decode_e4m3(row + t * TILE, clamp(TILE, r - t * TILE), s, dst + t * TILE);
    }
    decode_bf16(row + r + 4 * tiles, D - r, dst + r);
}

/* s[h * BLK + j - j0] = q[h] . rows[j] for j in [j0, j1), h < H: 4 rows x 4 heads per pass,
 * sixteen accumulators in registers (named, so the compiler keeps them there). Prefetches the
 * rows four ahead of the ones being scored (up to row nb - 1). */
static void scores(const float *q, int64_t H, int64_t D, const float *const *rows, int64_t j0, int64_t j1,
                   int64_t nb, float *s) {
    for (int64_t j = j0; j < j1; j += 4) {
        int64_t last = j1 - 1;
        const float *r0 = rows[j], *r1 = rows[clamp(j + 1, last)], *r2 = rows[clamp(j + 2, last)],
                    *r3 = rows[clamp(j + 3, last)];
        const float *n0 = rows[clamp(j + 4, nb - 1)], *n1 = rows[clamp(j + 5, nb - 1)],
                    *n2 = rows[clamp(j + 6, nb - 1)], *n3 = rows[clamp(j + 7, nb - 1)];
        for (int64_t h0 = 0; h0 < H; h0 += 4) {
            const float *q0 = q + h0 * D, *q1 = q + clamp(h0 + 1, H - 1) * D, *q2 = q + clamp(h0 + 2, H - 1) * D,
                        *q3 = q + clamp(h0 + 3, H - 1) * D;
            vf z = bcast(0.f);
            vf a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
            vf a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
            for (int64_t k = 0; k < D; k += V) {
                if (h0 == 0) {
                    __builtin_prefetch(n0 + k); __builtin_prefetch(n1 + k);
                    __builtin_prefetch(n2 + k); __builtin_prefetch(n3 + k);
                }
                vf x0 = ld(r0 + k), x1 = ld(r1 + k), x2 = ld(r2 + k), x3 = ld(r3 + k);
                vf y = ld(q0 + k);
                a00 += y * x0; a01 += y * x1; a02 += y * x2; a03 += y * x3;
                y = ld(q1 + k);
                a10 += y * x0; a11 += y * x1; a12 += y * x2; a13 += y * x3;
                y = ld(q2 + k);
                a20 += y * x0; a21 += y * x1; a22 += y * x2; a23 += y * x3;
                y = ld(q3 + k);
                a30 += y * x0; a31 += y * x1; a32 += y * x2; a33 += y * x3;
            }
            float t[4][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)}, {hsum(a10), hsum(a11), hsum(a12), hsum(a13)},
                             {hsum(a20), hsum(a21), hsum(a22), hsum(a23)}, {hsum(a30), hsum(a31), hsum(a32), hsum(a33)}};
            for (int a = 0; a < 4 && h0 + a < H; a++)
                for (int c = 0; c < 4 && j + c < j1; c++) s[(h0 + a) * BLK + j - j0 + c] = t[a][c];
        }
    }
}

/* o[h, :r] = corr[h] * o[h, :r] + sum_j p[h * BLK + j - j0] * rows[j][:r] for j in [j0, j1):
 * 4 heads x 64 columns of accumulators a pass, then 4 heads x 16 for the last columns. */
static void accumulate(const float *p, const float *corr, int64_t H, int64_t r, const float *const *rows,
                       int64_t j0, int64_t j1, float *o) {
    for (int64_t h0 = 0; h0 < H; h0 += 4) {
        int64_t h1 = clamp(h0 + 1, H - 1), h2 = clamp(h0 + 2, H - 1), h3 = clamp(h0 + 3, H - 1);
        const float *p0 = p + h0 * BLK - j0, *p1 = p + h1 * BLK - j0, *p2 = p + h2 * BLK - j0, *p3 = p + h3 * BLK - j0;
        float *o0 = o + h0 * r, *o1 = o + h1 * r, *o2 = o + h2 * r, *o3 = o + h3 * r;
        vf c0v = bcast(corr[h0]), c1v = bcast(corr[h1]), c2v = bcast(corr[h2]), c3v = bcast(corr[h3]);
        int64_t c = 0;
        for (; c + 4 * V <= r; c += 4 * V) {
            vf a00 = c0v * ld(o0 + c), a01 = c0v * ld(o0 + c + V), a02 = c0v * ld(o0 + c + 2 * V), a03 = c0v * ld(o0 + c + 3 * V);
            vf a10 = c1v * ld(o1 + c), a11 = c1v * ld(o1 + c + V), a12 = c1v * ld(o1 + c + 2 * V), a13 = c1v * ld(o1 + c + 3 * V);
            vf a20 = c2v * ld(o2 + c), a21 = c2v * ld(o2 + c + V), a22 = c2v * ld(o2 + c + 2 * V), a23 = c2v * ld(o2 + c + 3 * V);
            vf a30 = c3v * ld(o3 + c), a31 = c3v * ld(o3 + c + V), a32 = c3v * ld(o3 + c + 2 * V), a33 = c3v * ld(o3 + c + 3 * V);
            for (int64_t j = j0; j < j1; j++) {
                const float *row = rows[j] + c;
                vf x0 = ld(row), x1 = ld(row + V), x2 = ld(row + 2 * V), x3 = ld(row + 3 * V);
                vf w = bcast(p0[j]);
                a00 += w * x0; a01 += w * x1; a02 += w * x2; a03 += w * x3;
                w = bcast(p1[j]);
                a10 += w * x0; a11 += w * x1; a12 += w * x2; a13 += w * x3;
                w = bcast(p2[j]);
                a20 += w * x0; a21 += w * x1; a22 += w * x2; a23 += w * x3;
                w = bcast(p3[j]);
                a30 += w * x0; a31 += w * x1; a32 += w * x2; a33 += w * x3;
            }
            /* a clamped head (H not a multiple of 4) repeats the last one: stored last, same value */
            st(o3 + c, a30); st(o3 + c + V, a31); st(o3 + c + 2 * V, a32); st(o3 + c + 3 * V, a33);
            st(o2 + c, a20); st(o2 + c + V, a21); st(o2 + c + 2 * V, a22); st(o2 + c + 3 * V, a23);
            st(o1 + c, a10); st(o1 + c + V, a11); st(o1 + c + 2 * V, a12); st(o1 + c + 3 * V, a13);
            st(o0 + c, a00); st(o0 + c + V, a01); st(o0 + c + 2 * V, a02); st(o0 + c + 3 * V, a03);
        }
        for (; c < r; c += V) {
            vf a0 = c0v * ld(o0 + c), a1 = c1v * ld(o1 + c), a2 = c2v * ld(o2 + c), a3 = c3v * ld(o3 + c);
            for (int64_t j = j0; j < j1; j++) {
                vf x = ld(rows[j] + c);
                a0 += bcast(p0[j]) * x; a1 += bcast(p1[j]) * x; a2 += bcast(p2[j]) * x; a3 += bcast(p3[j]) * x;
            }
            st(o3 + c, a3); st(o2 + c, a2); st(o1 + c, a1); st(o0 + c, a0);
        }
    }
}

/* One work item: rows idx[0..nb) of one request; writes o [H, r] (unnormalised: sum_j
 * exp(s_j - m) row_j), m [H] (max score) and l [H] (sum_j exp(s_j - m)). s, corr: scratch;
 * deq: BLK * D floats of scratch for FP8 rows. */
static void segment(const uint8_t *pool, int64_t row_bytes, int kind, float kv_scale, int64_t D, const int64_t *idx,
                    int64_t nb, const float *q, int64_t H, int64_t r, float scale, float *s, float *corr, float *deq,
                    float *o, float *m, float *l) {
    const float *rows[SEG];
    if (kind == KIND_F32)
        for (int64_t j = 0; j < nb; j++) rows[j] = (const float *)(pool + idx[j] * row_bytes);
    memset(o, 0, sizeof(float) * H * r);
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    for (int64_t j0 = 0; j0 < nb; j0 += BLK) {
        int64_t j1 = clamp(j0 + BLK, nb), n = j1 - j0;
        if (kind != KIND_F32) {
            for (int64_t j = j1; j < clamp(j1 + BLK, nb); j++) /* the next block's rows, every line */
                for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(pool + idx[j] * row_bytes + c);
            for (int64_t j = j0; j < j1; j++) {
                rows[j] = deq + (j - j0) * D;
                decode_row(pool + idx[j] * row_bytes, kind, kv_scale, D, r, deq + (j - j0) * D);
            }
        }
        scores(q, H, D, rows, j0, j1, kind == KIND_F32 ? nb : j1, s);
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * BLK, mx = m[h], sum = 0.f;
            for (int64_t j = 0; j < n; j++) {
                sh[j] *= scale;
                if (sh[j] > mx) mx = sh[j];
            }
            corr[h] = m[h] == -INFINITY ? 0.f : expf(m[h] - mx);
            for (int64_t j = 0; j < n; j++) {
                sh[j] = expf(sh[j] - mx);
                sum += sh[j];
            }
            l[h] = l[h] * corr[h] + sum;
            m[h] = mx;
        }
        accumulate(s, corr, H, r, rows, j0, j1, o);
    }
}

int mla_decode_seg(void) { return SEG; }

int mla_decode_block(void) { return BLK; }

/* Items of request b are item_offs[b] .. item_offs[b+1); part_o [items, H, r], part_ml
 * [items, 2, H] and scratch [threads, H * SEG + BLK * D] (SEG >= BLK + 1) are scratch space.
 * out [B, H, r], lse [B, H]. Rows are row_bytes apart in the layout `kind` (see the top). */
void mla_decode(const uint8_t *pool, int64_t row_bytes, int kind, float kv_scale, int64_t D, const int64_t *idx,
                const int64_t *offs, const int64_t *item_offs, const float *q, int64_t B, int64_t H, int64_t r,
                float scale, float *part_o, float *part_ml, float *scratch, float *out, float *lse, int nthreads) {
    int64_t items = item_offs[B];
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        float *s = scratch + (int64_t)omp_get_thread_num() * (H * SEG + BLK * D);
#else
        float *s = scratch;
#endif
        /* contiguous runs of items per thread: a thread's next item is usually the next rows */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t lo = 0, hi = B; /* the request of this item: item_offs[b] <= it < item_offs[b+1] */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (item_offs[mid] <= it) lo = mid; else hi = mid;
            }
            int64_t b = lo, start = offs[b] + (it - item_offs[b]) * SEG;
            segment(pool, row_bytes, kind, kv_scale, D, idx + start, clamp(SEG, offs[b + 1] - start), q + b * H * D, H,
                    r, scale, s, s + H * BLK, s + H * SEG, part_o + it * H * r, part_ml + it * 2 * H,
                    part_ml + it * 2 * H + H);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            int64_t first = item_offs[b], last = item_offs[b + 1];
            float *ob = out + b * H * r;
            for (int64_t h = 0; h < H; h++) {
                float mx = -INFINITY, total = 0.f;
                for (int64_t it = first; it < last; it++) {
                    float mi = part_ml[it * 2 * H + h];
                    if (mi > mx) mx = mi;
                }
                float *oh = ob + h * r;
                memset(oh, 0, sizeof(float) * r);
                for (int64_t it = first; it < last; it++) {
                    float w = expf(part_ml[it * 2 * H + h] - mx);
                    total += w * part_ml[it * 2 * H + H + h];
                    const float *po = part_o + (it * H + h) * r;
                    for (int64_t c = 0; c < r; c++) oh[c] += w * po[c];
                }
                if (total > 0.f) {
                    float inv = 1.f / total;
                    for (int64_t c = 0; c < r; c++) oh[c] *= inv;
                    lse[b * H + h] = mx + logf(total);
                } else {
                    lse[b * H + h] = -INFINITY;
                }
            }
        }
    }
}

/* The DCP exchange around this kernel (engine/parallel/dcp.py, a2a): each rank attends over its
 * own rows for every head and sends head slice c of its partials to rank c. At batch 1 packing
 * them was five tiny torch ops a layer, whose dispatch, not their bytes, was the cost.
 * out [B, H, r] and lse [B, H] -> send [C, B, H/C, r + 1] (lse in the last column). */
void dcp_pack(const float *out, const float *lse, int64_t B, int64_t H, int64_t r, int64_t C, float *send) {
    int64_t per = H / C;
    for (int64_t c = 0; c < C; c++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < per; j++) {
                int64_t h = c * per + j;
                float *dst = send + ((c * B + b) * per + j) * (r + 1);
                memcpy(dst, out + (b * H + h) * r, sizeof(float) * r);
                dst[r] = lse[b * H + h];
            }
}
