/* The fused quantising kernels of kvbus.codecs (see kvbus/codecs/_native.py).
 *
 * Each function does, for one contiguous [rows, ...] block, in one or two passes over data that
 * stays in the L1/L2 cache, what the eager torch kernels of _kernels.py do in five to eight
 * passes over a layer: read bfloat16 (or float32), reduce, compute the scale, divide, round
 * half to even and pack. The arithmetic is the same IEEE operation for operation (float32
 * division, the 1.5 * 2**23 rounding add, scales rounded up to the KV dtype from a float64
 * quotient, the float32 -> bfloat16 round to nearest even torch uses), so the codes and scales
 * are bit for bit those of the torch kernels: tests/test_kernels.py checks it. Built without
 * -ffast-math and with -ffp-contract=off: no reassociation, no reciprocal, no fused multiply-add
 * that would round differently.
 *
 * The division: a float32 division costs several times a multiplication on AVX-512 (and was
 * the encoders' bottleneck); each code is computed as round(x * (1 / scale)) instead, and a row
 * in which any product lies within `NEAR_HALF` of a half-integer (where the two could round
 * apart) is recomputed with the division. |x / scale| <= 127.5, and x * fl(1 / scale) differs
 * from x / scale by at most 127.5 * 2**-23 < 1.6e-5, plus half an ulp of the quotient (3.9e-6):
 * far inside the margin of 2**-14 (6.1e-5). About one row in a hundred is recomputed.
 *
 * Layouts: keys are [bh, s, d] with a scale per (bh, channel); values [r, d] with a scale per
 * row. Scales and bfloat16 data travel as their uint16 bit patterns. Heads are at most CHUNK
 * channels wide (_native.MAX_CHANNELS).
 */
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

#define MAGIC 12582912.0f /* 1.5 * 2**23: x + MAGIC holds round-half-even(x) in its low bits */

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* a if c else b, in arithmetic: a ?: that mixes widths keeps GCC from vectorising a loop. */
static inline uint16_t pick16(int c, uint16_t a, uint16_t b) {
    uint16_t m = (uint16_t)-(uint16_t)(c != 0);
    return (uint16_t)(b ^ ((b ^ a) & m));
}

static inline float pick32(int c, float a, float b) {
    uint32_t m = -(uint32_t)(c != 0), r = f32_bits(b) ^ ((f32_bits(b) ^ f32_bits(a)) & m);
    float f;
    memcpy(&f, &r, 4);
    return f;
}

/* float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's rule). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r; /* vectorises in loops of floats (the decoders) */
}

/* The same in integer arithmetic: vectorises in the loops that mix float64 and uint16 (scales). */
static inline uint16_t f32_to_bf16_int(float f) {
    uint32_t u = f32_bits(f);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return pick16((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0, r);
}

/* The smallest bfloat16 >= exact (exact >= 0, or NaN / inf), the way _kernels._step_up gets it:
 * round through float32 to nearest even, then one ulp up if that fell below exact. */
static inline uint16_t bf16_ceil(double exact) {
    uint16_t b = f32_to_bf16_int((float)exact);
    return (uint16_t)(b + ((double)bf16_to_f32(b) < exact));
}

/* The same for float32: round to nearest, then one ulp up if below. */
static inline float f32_ceil(double exact) {
    float f = (float)exact;
    uint32_t u = f32_bits(f) + (uint32_t)((double)f < exact);
    memcpy(&f, &u, 4);
    return f;
}

/* The low byte of t + MAGIC: t rounded half to even (the int8 code as the torch kernels'
 * int32 -> int8 conversion takes it), defined for NaN and inf too. */
static inline uint8_t low_byte(float t) { return (uint8_t)f32_bits(t + MAGIC); }

/* Distance of t from its nearest integer, above which x * (1 / s) may round unlike x / s. */
#define NEAR_HALF (0.5f - 6.103515625e-05f) /* 0.5 - 2**-14 */

/* Whether the product t may round unlike the quotient (near a half-integer, or not finite). */
static inline int unsure(float t) {
    float k = (t + MAGIC) - MAGIC;
    return !(fabsf(t - k) < NEAR_HALF);
}

#define CHUNK 256 /* widest head (channels per key row) */
#define BLOCK 64  /* value rows whose scales are computed together */

/* Codes of one row of n float32 values: round(f / sc) with a scale (and its reciprocal) per
 * element, through the reciprocal unless a product is unsure. */
static inline void codes_vec(const float *restrict f, const float *restrict sc, const float *restrict rc,
                             uint8_t *restrict out, int64_t n) {
    int bad = 0;
    for (int64_t c = 0; c < n; c++) {
        float t = f[c] * rc[c];
        bad |= unsure(t);
        out[c] = low_byte(t);
    }
    if (bad)
        for (int64_t c = 0; c < n; c++) out[c] = low_byte(f[c] / sc[c]);
}

/* The same with one scale for the row. */
static inline void codes_one(const float *restrict f, float sc, float rc, uint8_t *restrict out, int64_t n) {
    int bad = 0;
    for (int64_t c = 0; c < n; c++) {
        float t = f[c] * rc;
        bad |= unsure(t);
        out[c] = low_byte(t);
    }
    if (bad)
        for (int64_t c = 0; c < n; c++) out[c] = low_byte(f[c] / sc);
}

static inline void widen_bf16(const uint16_t *restrict x, float *restrict f, int64_t n) {
    for (int64_t c = 0; c < n; c++) f[c] = bf16_to_f32(x[c]);
}

/* The scale of an absmax (|x| as bits: integer order is float order, NaN above inf). */
/* exact (x / 127, x / 15) + 1 when x is 0 (a zero slice gets scale 1): x / n + 0.0 is x / n. */
static inline uint16_t int8_scale_bf16(uint16_t am) {
    double a = (double)bf16_to_f32(am);
    return bf16_ceil(a / 127.0 + (double)(a == 0));
}

static inline float int8_scale_f32(uint32_t am) {
    float af;
    memcpy(&af, &am, 4);
    double a = (double)af;
    return f32_ceil(a / 127.0 + (double)(a == 0));
}

/* Each kernel is an inlined body and an exported function that calls it with the common head
 * dimensions (and groups) as constants, so that the compiler unrolls the short inner loops. */

/* ---- int8, symmetric absmax ------------------------------------------------------------------ */

static inline __attribute__((always_inline)) void int8_enc_keys_bf16_body(const uint16_t *restrict x, int8_t *restrict q, uint16_t *restrict scale, int64_t bh,
                        int64_t s, int64_t d) {
    uint16_t am[CHUNK];
    float sc[CHUNK], rc[CHUNK], f[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const uint16_t *xr = x + r * s * d;
        for (int64_t c = 0; c < d; c++) am[c] = 0;
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                uint16_t a = xr[t * d + c] & 0x7FFF;
                am[c] = a > am[c] ? a : am[c];
            }
        for (int64_t c = 0; c < d; c++) {
            uint16_t b = scale[r * d + c] = int8_scale_bf16(am[c]);
            sc[c] = bf16_to_f32(b);
            rc[c] = 1.0f / sc[c];
        }
        for (int64_t t = 0; t < s; t++) {
            widen_bf16(xr + t * d, f, d);
            codes_vec(f, sc, rc, (uint8_t *)q + (r * s + t) * d, d);
        }
    }
}

static inline __attribute__((always_inline)) void int8_enc_rows_bf16_body(const uint16_t *restrict x, int8_t *restrict q, uint16_t *restrict scale, int64_t rows,
                        int64_t d) {
    float f[CHUNK];
    uint16_t am[BLOCK];
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        int64_t nb = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        for (int64_t i = 0; i < nb; i++) {
            const uint16_t *row = x + (r0 + i) * d;
            uint16_t m = 0;
            for (int64_t c = 0; c < d; c++) {
                uint16_t a = row[c] & 0x7FFF;
                m = a > m ? a : m;
            }
            am[i] = m;
        }
        for (int64_t i = 0; i < nb; i++) scale[r0 + i] = int8_scale_bf16(am[i]);
        for (int64_t i = 0; i < nb; i++) {
            float sc = bf16_to_f32(scale[r0 + i]);
            for (int64_t c0 = 0; c0 < d; c0 += CHUNK) {
                int64_t n = d - c0 < CHUNK ? d - c0 : CHUNK;
                widen_bf16(x + (r0 + i) * d + c0, f, n);
                codes_one(f, sc, 1.0f / sc, (uint8_t *)q + (r0 + i) * d + c0, n);
            }
        }
    }
}

static inline __attribute__((always_inline)) void int8_enc_keys_f32_body(const float *restrict x, int8_t *restrict q, float *restrict scale, int64_t bh, int64_t s,
                       int64_t d) {
    uint32_t am[CHUNK];
    float sc[CHUNK], rc[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const float *xr = x + r * s * d;
        for (int64_t c = 0; c < d; c++) am[c] = 0;
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                uint32_t a = f32_bits(xr[t * d + c]) & 0x7FFFFFFFu;
                am[c] = a > am[c] ? a : am[c];
            }
        for (int64_t c = 0; c < d; c++) {
            sc[c] = scale[r * d + c] = int8_scale_f32(am[c]);
            rc[c] = 1.0f / sc[c];
        }
        for (int64_t t = 0; t < s; t++) codes_vec(xr + t * d, sc, rc, (uint8_t *)q + (r * s + t) * d, d);
    }
}

static inline __attribute__((always_inline)) void int8_enc_rows_f32_body(const float *restrict x, int8_t *restrict q, float *restrict scale, int64_t rows, int64_t d) {
    uint32_t am[BLOCK];
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        int64_t nb = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        for (int64_t i = 0; i < nb; i++) {
            const float *row = x + (r0 + i) * d;
            uint32_t m = 0;
            for (int64_t c = 0; c < d; c++) {
                uint32_t a = f32_bits(row[c]) & 0x7FFFFFFFu;
                m = a > m ? a : m;
            }
            am[i] = m;
        }
        for (int64_t i = 0; i < nb; i++) scale[r0 + i] = int8_scale_f32(am[i]);
        for (int64_t i = 0; i < nb; i++) {
            float sc = scale[r0 + i];
            codes_one(x + (r0 + i) * d, sc, 1.0f / sc, (uint8_t *)q + (r0 + i) * d, d);
        }
    }
}

/* q * scale rounded once to bfloat16 (the product is exact in float32: 8 by 8 significant bits). */
static inline __attribute__((always_inline)) void int8_dec_keys_bf16_body(const int8_t *restrict q, const uint16_t *restrict scale, uint16_t *restrict out, int64_t bh,
                        int64_t s, int64_t d) {
    float sc[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t c = 0; c < d; c++) sc[c] = bf16_to_f32(scale[r * d + c]);
        for (int64_t t = 0; t < s; t++) {
            const int8_t *in = q + (r * s + t) * d;
            uint16_t *o = out + (r * s + t) * d;
            for (int64_t c = 0; c < d; c++) o[c] = f32_to_bf16((float)in[c] * sc[c]);
        }
    }
}

static inline __attribute__((always_inline)) void int8_dec_rows_bf16_body(const int8_t *restrict q, const uint16_t *restrict scale, uint16_t *restrict out,
                        int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        float sc = bf16_to_f32(scale[r]);
        const int8_t *in = q + r * d;
        uint16_t *o = out + r * d;
        for (int64_t c = 0; c < d; c++) o[c] = f32_to_bf16((float)in[c] * sc);
    }
}

/* ---- int4, asymmetric min/max in groups, two codes per byte (the first in the low nibble) ------ */

/* Whether n bfloat16 (float32) values hold a NaN (|x| as bits above inf's). */
static inline int has_nan_bf16(const uint16_t *restrict x, int64_t n) {
    int any = 0;
    for (int64_t i = 0; i < n; i++) any |= (x[i] & 0x7FFF) > 0x7F80;
    return any;
}

static inline int has_nan_f32(const float *restrict x, int64_t n) {
    int any = 0;
    for (int64_t i = 0; i < n; i++) any |= (f32_bits(x[i]) & 0x7FFFFFFFu) > 0x7F800000u;
    return any;
}

/* The low (the minimum, exact in bfloat16) and the scale of n groups from their float32 minimums
 * and maximums; a NaN in a group (nan[i]) makes both NaN, as torch's amin / amax propagate it. */
static inline void int4_ranges_bf16(const float *restrict mn, const float *restrict mx, const int *restrict nan,
                                    uint16_t *restrict low, uint16_t *restrict scale, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t lb = f32_to_bf16_int(mn[i]);
        double span = (double)mx[i] - (double)bf16_to_f32(lb);
        uint16_t b = bf16_ceil(span / 15.0 + (double)(span == 0));
        low[i] = pick16(nan[i], 0x7FC0, lb);
        scale[i] = pick16(nan[i], 0x7FC0, b);
    }
}

/* Two codes per byte: out[i] = codes[2i] | codes[2i + 1] << 4, each pair read as one little-endian
 * uint16 (codes are 0..15, or garbage for a NaN group: masked). */
static inline void pack4(const uint8_t *restrict codes, uint8_t *restrict out, int64_t n) {
    for (int64_t i = 0; i < n / 2; i++) {
        uint16_t w;
        memcpy(&w, codes + 2 * i, 2);
        w &= 0x0F0F;
        out[i] = (uint8_t)(w | (w >> 4));
    }
}

/* The inverse: codes[2i], codes[2i + 1] = in[i] & 15, in[i] >> 4, as float32. */
static inline void unpack4(const uint8_t *restrict in, float *restrict codes, int64_t n) {
    uint8_t bytes[CHUNK];
    for (int64_t i = 0; i < n / 2; i++) {
        uint16_t w = (uint16_t)((in[i] & 0x0F) | ((in[i] & 0xF0) << 4));
        memcpy(bytes + 2 * i, &w, 2);
    }
    for (int64_t c = 0; c < n; c++) codes[c] = (float)bytes[c];
}

/* Keys: [bh, s, d] bfloat16 (d even) in groups of g tokens per channel, the sequence padded to
 * whole groups by repeating the last token. scale and low: [bh, groups, d]; packed: the codes of
 * the padded [bh, groups * g, d] in order, two per byte. */
static inline __attribute__((always_inline)) void int4_enc_keys_bf16_body(const uint16_t *restrict x, uint8_t *restrict packed, uint16_t *restrict scale,
                        uint16_t *restrict low, int64_t bh, int64_t s, int64_t d, int64_t g) {
    int64_t groups = (s + g - 1) / g;
    float mn[CHUNK], mx[CHUNK], lo[CHUNK], sc[CHUNK], rc[CHUNK], f[CHUNK];
    int nan[CHUNK];
    uint8_t codes[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const uint16_t *xr = x + r * s * d;
        int any_nan = has_nan_bf16(xr, s * d); /* rare: the group loop tracks NaN only then */
        for (int64_t j = 0; j < groups; j++) {
            int64_t t0 = j * g, t1 = t0 + g < s ? t0 + g : s;
            widen_bf16(xr + t0 * d, mn, d);
            for (int64_t c = 0; c < d; c++) {
                mx[c] = mn[c];
                nan[c] = 0;
            }
            for (int64_t t = t0; t < t1; t++) {
                widen_bf16(xr + t * d, f, d);
                for (int64_t c = 0; c < d; c++) {
                    float v = f[c];
                    mn[c] = v < mn[c] ? v : mn[c];
                    mx[c] = v > mx[c] ? v : mx[c];
                }
                if (any_nan)
                    for (int64_t c = 0; c < d; c++) nan[c] |= f[c] != f[c];
            }
            uint16_t *ls = low + (r * groups + j) * d, *ss = scale + (r * groups + j) * d;
            int4_ranges_bf16(mn, mx, nan, ls, ss, d);
            for (int64_t c = 0; c < d; c++) {
                lo[c] = bf16_to_f32(ls[c]);
                sc[c] = bf16_to_f32(ss[c]);
                rc[c] = 1.0f / sc[c];
            }
            for (int64_t t = t0; t < t0 + g; t++) {
                widen_bf16(xr + (t < s ? t : s - 1) * d, f, d);
                for (int64_t c = 0; c < d; c++) f[c] -= lo[c];
                codes_vec(f, sc, rc, codes, d);
                pack4(codes, packed + ((r * groups * g + t) * d) / 2, d);
            }
        }
    }
}

/* The minimum and maximum of each group of g consecutive values of f[0..d) (g divides d), and
 * whether it holds a NaN. A power-of-two g is reduced as a tree, which vectorises (a sequential
 * min does not); it keeps the same values, except that of a -0.0 and a 0.0 tied for the minimum
 * (or maximum) either may come out (torch's own reductions differ there too). */
static inline __attribute__((always_inline)) void group_ranges(const float *restrict f, float *restrict mn,
                                                               float *restrict mx, int *restrict nan, int64_t d,
                                                               int64_t g) {
    int64_t per = d / g;
    int any = 0;
    for (int64_t c = 0; c < d; c++) any |= f[c] != f[c];
#ifdef __AVX512F__
    if (g == 32) { /* two vectors a group: one min / max of them, then one horizontal reduction */
        for (int64_t j = 0; j < per; j++) {
            __m512 u = _mm512_loadu_ps(f + j * 32), v = _mm512_loadu_ps(f + j * 32 + 16);
            mn[j] = _mm512_reduce_min_ps(_mm512_min_ps(u, v));
            mx[j] = _mm512_reduce_max_ps(_mm512_max_ps(u, v));
        }
    } else
#endif
    if ((g & (g - 1)) == 0 && g >= 2) {
        float a[CHUNK], b[CHUNK];
        int64_t w = g / 2;
        for (int64_t j = 0; j < per; j++)
            for (int64_t c = 0; c < w; c++) {
                float u = f[j * g + c], v = f[j * g + c + w];
                a[j * g + c] = v < u ? v : u;
                b[j * g + c] = v > u ? v : u;
            }
        for (w /= 2; w >= 1; w /= 2)
            for (int64_t j = 0; j < per; j++)
                for (int64_t c = 0; c < w; c++) {
                    float u = a[j * g + c], v = a[j * g + c + w];
                    a[j * g + c] = v < u ? v : u;
                    u = b[j * g + c], v = b[j * g + c + w];
                    b[j * g + c] = v > u ? v : u;
                }
        for (int64_t j = 0; j < per; j++) {
            mn[j] = a[j * g];
            mx[j] = b[j * g];
        }
    } else {
        for (int64_t j = 0; j < per; j++) {
            float u = f[j * g], v = u;
            for (int64_t c = 0; c < g; c++) {
                u = f[j * g + c] < u ? f[j * g + c] : u;
                v = f[j * g + c] > v ? f[j * g + c] : v;
            }
            mn[j] = u;
            mx[j] = v;
        }
    }
    for (int64_t j = 0; j < per; j++) nan[j] = 0;
    if (any)
        for (int64_t j = 0; j < per; j++)
            for (int64_t c = 0; c < g; c++) nan[j] |= f[j * g + c] != f[j * g + c];
}

/* Values: [rows, d] bfloat16 in groups of g channels per row (g even, dividing d, d at most
 * CHUNK). scale and low: [rows, d / g]; packed: the codes in order, two per byte. The ranges of
 * BLOCK rows are computed together (their float64 divisions vectorise). */
static inline __attribute__((always_inline)) void int4_enc_rows_bf16_body(const uint16_t *restrict x, uint8_t *restrict packed, uint16_t *restrict scale,
                        uint16_t *restrict low, int64_t rows, int64_t d, int64_t g) {
    int64_t per = d / g;
    float f[CHUNK], mn[BLOCK * CHUNK / 2], mx[BLOCK * CHUNK / 2];
    int nan[BLOCK * CHUNK / 2];
    uint8_t codes[CHUNK];
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        int64_t nb = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        for (int64_t i = 0; i < nb; i++) {
            widen_bf16(x + (r0 + i) * d, f, d);
            group_ranges(f, mn + i * per, mx + i * per, nan + i * per, d, g);
        }
        int4_ranges_bf16(mn, mx, nan, low + r0 * per, scale + r0 * per, nb * per);
        for (int64_t i = 0; i < nb; i++) {
            int64_t r = r0 + i;
            float lo_e[CHUNK], sc_e[CHUNK], rc_e[CHUNK]; /* each group's low and scale, per element */
            for (int64_t j = 0; j < per; j++) {
                float lo = bf16_to_f32(low[r * per + j]), sc = bf16_to_f32(scale[r * per + j]), rc = 1.0f / sc;
                for (int64_t c = 0; c < g; c++) {
                    lo_e[j * g + c] = lo;
                    sc_e[j * g + c] = sc;
                    rc_e[j * g + c] = rc;
                }
            }
            widen_bf16(x + r * d, f, d);
            for (int64_t c = 0; c < d; c++) f[c] -= lo_e[c];
            codes_vec(f, sc_e, rc_e, codes, d);
            pack4(codes, packed + (r * d) / 2, d);
        }
    }
}

/* bfloat16(code * scale + low): the product is exact in float32 (4 by 8 significant bits), so
 * only the sum rounds, then the cast (as the torch kernels compute it). */
static inline __attribute__((always_inline)) void int4_dec_keys_bf16_body(const uint8_t *restrict packed, const uint16_t *restrict scale, const uint16_t *restrict low,
                        uint16_t *restrict out, int64_t bh, int64_t s, int64_t d, int64_t g) {
    int64_t groups = (s + g - 1) / g;
    float lo[CHUNK], sc[CHUNK], f[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t j = 0; j < groups; j++) {
            const uint16_t *ls = low + (r * groups + j) * d, *ss = scale + (r * groups + j) * d;
            for (int64_t c = 0; c < d; c++) {
                lo[c] = bf16_to_f32(ls[c]);
                sc[c] = bf16_to_f32(ss[c]);
            }
            int64_t t1 = j * g + g < s ? j * g + g : s;
            for (int64_t t = j * g; t < t1; t++) {
                unpack4(packed + ((r * groups * g + t) * d) / 2, f, d);
                uint16_t *o = out + (r * s + t) * d;
                for (int64_t c = 0; c < d; c++) o[c] = f32_to_bf16(f[c] * sc[c] + lo[c]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void int4_dec_rows_bf16_body(const uint8_t *restrict packed, const uint16_t *restrict scale, const uint16_t *restrict low,
                        uint16_t *restrict out, int64_t rows, int64_t d, int64_t g) {
    int64_t per = d / g;
    float f[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        unpack4(packed + (r * d) / 2, f, d);
        uint16_t *o = out + r * d;
        for (int64_t j = 0; j < per; j++) {
            float lo = bf16_to_f32(low[r * per + j]), sc = bf16_to_f32(scale[r * per + j]);
            for (int64_t c = 0; c < g; c++) o[j * g + c] = f32_to_bf16(f[j * g + c] * sc + lo);
        }
    }
}

/* ---- float32 variants of the int4 kernels and of int8's decoders (the bodies above, with float32
 * loads and stores: the low is the minimum itself, the scale rounded up in float32). torch's
 * float32 addcmul rounds code * scale + low once (a fused multiply-add): int4's decoders do too. */

static inline void widen_f32(const float *restrict x, float *restrict f, int64_t n) {
    for (int64_t c = 0; c < n; c++) f[c] = x[c];
}

static inline void int4_ranges_f32(const float *restrict mn, const float *restrict mx, const int *restrict nan,
                                   float *restrict low, float *restrict scale, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double span = (double)mx[i] - (double)mn[i];
        float b = f32_ceil(span / 15.0 + (double)(span == 0));
        low[i] = pick32(nan[i], __builtin_nanf(""), mn[i]);
        scale[i] = pick32(nan[i], __builtin_nanf(""), b);
    }
}

static inline __attribute__((always_inline)) void int8_dec_keys_f32_body(const int8_t *restrict q, const float *restrict scale, float *restrict out, int64_t bh,
                        int64_t s, int64_t d) {
    float sc[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t c = 0; c < d; c++) sc[c] = (scale[r * d + c]);
        for (int64_t t = 0; t < s; t++) {
            const int8_t *in = q + (r * s + t) * d;
            float *o = out + (r * s + t) * d;
            for (int64_t c = 0; c < d; c++) o[c] = ((float)in[c] * sc[c]);
        }
    }
}

static inline __attribute__((always_inline)) void int8_dec_rows_f32_body(const int8_t *restrict q, const float *restrict scale, float *restrict out,
                        int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        float sc = (scale[r]);
        const int8_t *in = q + r * d;
        float *o = out + r * d;
        for (int64_t c = 0; c < d; c++) o[c] = ((float)in[c] * sc);
    }
}

static inline __attribute__((always_inline)) void int4_enc_keys_f32_body(const float *restrict x, uint8_t *restrict packed, float *restrict scale,
                        float *restrict low, int64_t bh, int64_t s, int64_t d, int64_t g) {
    int64_t groups = (s + g - 1) / g;
    float mn[CHUNK], mx[CHUNK], lo[CHUNK], sc[CHUNK], rc[CHUNK], f[CHUNK];
    int nan[CHUNK];
    uint8_t codes[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const float *xr = x + r * s * d;
        int any_nan = has_nan_f32(xr, s * d); /* rare: the group loop tracks NaN only then */
        for (int64_t j = 0; j < groups; j++) {
            int64_t t0 = j * g, t1 = t0 + g < s ? t0 + g : s;
            widen_f32(xr + t0 * d, mn, d);
            for (int64_t c = 0; c < d; c++) {
                mx[c] = mn[c];
                nan[c] = 0;
            }
            for (int64_t t = t0; t < t1; t++) {
                widen_f32(xr + t * d, f, d);
                for (int64_t c = 0; c < d; c++) {
                    float v = f[c];
                    mn[c] = v < mn[c] ? v : mn[c];
                    mx[c] = v > mx[c] ? v : mx[c];
                }
                if (any_nan)
                    for (int64_t c = 0; c < d; c++) nan[c] |= f[c] != f[c];
            }
            float *ls = low + (r * groups + j) * d, *ss = scale + (r * groups + j) * d;
            int4_ranges_f32(mn, mx, nan, ls, ss, d);
            for (int64_t c = 0; c < d; c++) {
                lo[c] = (ls[c]);
                sc[c] = (ss[c]);
                rc[c] = 1.0f / sc[c];
            }
            for (int64_t t = t0; t < t0 + g; t++) {
                widen_f32(xr + (t < s ? t : s - 1) * d, f, d);
                for (int64_t c = 0; c < d; c++) f[c] -= lo[c];
                codes_vec(f, sc, rc, codes, d);
                pack4(codes, packed + ((r * groups * g + t) * d) / 2, d);
            }
        }
    }
}

static inline __attribute__((always_inline)) void int4_enc_rows_f32_body(const float *restrict x, uint8_t *restrict packed, float *restrict scale,
                        float *restrict low, int64_t rows, int64_t d, int64_t g) {
    int64_t per = d / g;
    float f[CHUNK], mn[BLOCK * CHUNK / 2], mx[BLOCK * CHUNK / 2];
    int nan[BLOCK * CHUNK / 2];
    uint8_t codes[CHUNK];
    for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
        int64_t nb = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        for (int64_t i = 0; i < nb; i++) {
            widen_f32(x + (r0 + i) * d, f, d);
            group_ranges(f, mn + i * per, mx + i * per, nan + i * per, d, g);
        }
        int4_ranges_f32(mn, mx, nan, low + r0 * per, scale + r0 * per, nb * per);
        for (int64_t i = 0; i < nb; i++) {
            int64_t r = r0 + i;
            float lo_e[CHUNK], sc_e[CHUNK], rc_e[CHUNK]; /* each group's low and scale, per element */
            for (int64_t j = 0; j < per; j++) {
                float lo = (low[r * per + j]), sc = (scale[r * per + j]), rc = 1.0f / sc;
                for (int64_t c = 0; c < g; c++) {
                    lo_e[j * g + c] = lo;
                    sc_e[j * g + c] = sc;
                    rc_e[j * g + c] = rc;
                }
            }
            widen_f32(x + r * d, f, d);
            for (int64_t c = 0; c < d; c++) f[c] -= lo_e[c];
            codes_vec(f, sc_e, rc_e, codes, d);
            pack4(codes, packed + (r * d) / 2, d);
        }
    }
}

static inline __attribute__((always_inline)) void int4_dec_keys_f32_body(const uint8_t *restrict packed, const float *restrict scale, const float *restrict low,
                        float *restrict out, int64_t bh, int64_t s, int64_t d, int64_t g) {
    int64_t groups = (s + g - 1) / g;
    float lo[CHUNK], sc[CHUNK], f[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t j = 0; j < groups; j++) {
            const float *ls = low + (r * groups + j) * d, *ss = scale + (r * groups + j) * d;
            for (int64_t c = 0; c < d; c++) {
                lo[c] = (ls[c]);
                sc[c] = (ss[c]);
            }
            int64_t t1 = j * g + g < s ? j * g + g : s;
            for (int64_t t = j * g; t < t1; t++) {
                unpack4(packed + ((r * groups * g + t) * d) / 2, f, d);
                float *o = out + (r * s + t) * d;
                for (int64_t c = 0; c < d; c++) o[c] = fmaf(f[c], sc[c], lo[c]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void int4_dec_rows_f32_body(const uint8_t *restrict packed, const float *restrict scale, const float *restrict low,
                        float *restrict out, int64_t rows, int64_t d, int64_t g) {
    int64_t per = d / g;
    float f[CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        unpack4(packed + (r * d) / 2, f, d);
        float *o = out + r * d;
        for (int64_t j = 0; j < per; j++) {
            float lo = (low[r * per + j]), sc = (scale[r * per + j]);
            for (int64_t c = 0; c < g; c++) o[j * g + c] = fmaf(f[j * g + c], sc, lo);
        }
    }
}


void int8_enc_keys_bf16(const uint16_t *restrict x, int8_t *restrict q, uint16_t *restrict scale, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8_enc_keys_bf16_body(x, q, scale, bh, s, 128);
    else if (d == 64)
        int8_enc_keys_bf16_body(x, q, scale, bh, s, 64);
    else
        int8_enc_keys_bf16_body(x, q, scale, bh, s, d);
}

void int8_enc_rows_bf16(const uint16_t *restrict x, int8_t *restrict q, uint16_t *restrict scale, int64_t rows, int64_t d) {
    if (d == 128)
        int8_enc_rows_bf16_body(x, q, scale, rows, 128);
    else if (d == 64)
        int8_enc_rows_bf16_body(x, q, scale, rows, 64);
    else
        int8_enc_rows_bf16_body(x, q, scale, rows, d);
}

void int8_enc_keys_f32(const float *restrict x, int8_t *restrict q, float *restrict scale, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8_enc_keys_f32_body(x, q, scale, bh, s, 128);
    else if (d == 64)
        int8_enc_keys_f32_body(x, q, scale, bh, s, 64);
    else
        int8_enc_keys_f32_body(x, q, scale, bh, s, d);
}

void int8_enc_rows_f32(const float *restrict x, int8_t *restrict q, float *restrict scale, int64_t rows, int64_t d) {
    if (d == 128)
        int8_enc_rows_f32_body(x, q, scale, rows, 128);
    else if (d == 64)
        int8_enc_rows_f32_body(x, q, scale, rows, 64);
    else
        int8_enc_rows_f32_body(x, q, scale, rows, d);
}

void int8_dec_keys_bf16(const int8_t *restrict q, const uint16_t *restrict scale, uint16_t *restrict out, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8_dec_keys_bf16_body(q, scale, out, bh, s, 128);
    else if (d == 64)
        int8_dec_keys_bf16_body(q, scale, out, bh, s, 64);
    else
        int8_dec_keys_bf16_body(q, scale, out, bh, s, d);
}

void int8_dec_rows_bf16(const int8_t *restrict q, const uint16_t *restrict scale, uint16_t *restrict out, int64_t rows, int64_t d) {
    if (d == 128)
        int8_dec_rows_bf16_body(q, scale, out, rows, 128);
    else if (d == 64)
        int8_dec_rows_bf16_body(q, scale, out, rows, 64);
    else
        int8_dec_rows_bf16_body(q, scale, out, rows, d);
}

void int4_enc_keys_bf16(const uint16_t *restrict x, uint8_t *restrict packed, uint16_t *restrict scale, uint16_t *restrict low, int64_t bh, int64_t s, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_enc_keys_bf16_body(x, packed, scale, low, bh, s, 128, 32);
    else if (d == 64 && g == 32)
        int4_enc_keys_bf16_body(x, packed, scale, low, bh, s, 64, 32);
    else
        int4_enc_keys_bf16_body(x, packed, scale, low, bh, s, d, g);
}

void int4_enc_rows_bf16(const uint16_t *restrict x, uint8_t *restrict packed, uint16_t *restrict scale, uint16_t *restrict low, int64_t rows, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_enc_rows_bf16_body(x, packed, scale, low, rows, 128, 32);
    else if (d == 64 && g == 32)
        int4_enc_rows_bf16_body(x, packed, scale, low, rows, 64, 32);
    else
        int4_enc_rows_bf16_body(x, packed, scale, low, rows, d, g);
}

void int4_dec_keys_bf16(const uint8_t *restrict packed, const uint16_t *restrict scale, const uint16_t *restrict low, uint16_t *restrict out, int64_t bh, int64_t s, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_dec_keys_bf16_body(packed, scale, low, out, bh, s, 128, 32);
    else if (d == 64 && g == 32)
        int4_dec_keys_bf16_body(packed, scale, low, out, bh, s, 64, 32);
    else
        int4_dec_keys_bf16_body(packed, scale, low, out, bh, s, d, g);
}

void int4_dec_rows_bf16(const uint8_t *restrict packed, const uint16_t *restrict scale, const uint16_t *restrict low, uint16_t *restrict out, int64_t rows, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_dec_rows_bf16_body(packed, scale, low, out, rows, 128, 32);
    else if (d == 64 && g == 32)
        int4_dec_rows_bf16_body(packed, scale, low, out, rows, 64, 32);
    else
        int4_dec_rows_bf16_body(packed, scale, low, out, rows, d, g);
}

void int8_dec_keys_f32(const int8_t *restrict q, const float *restrict scale, float *restrict out, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8_dec_keys_f32_body(q, scale, out, bh, s, 128);
    else if (d == 64)
        int8_dec_keys_f32_body(q, scale, out, bh, s, 64);
    else
        int8_dec_keys_f32_body(q, scale, out, bh, s, d);
}

void int8_dec_rows_f32(const int8_t *restrict q, const float *restrict scale, float *restrict out, int64_t rows, int64_t d) {
    if (d == 128)
        int8_dec_rows_f32_body(q, scale, out, rows, 128);
    else if (d == 64)
        int8_dec_rows_f32_body(q, scale, out, rows, 64);
    else
        int8_dec_rows_f32_body(q, scale, out, rows, d);
}

void int4_enc_keys_f32(const float *restrict x, uint8_t *restrict packed, float *restrict scale, float *restrict low, int64_t bh, int64_t s, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_enc_keys_f32_body(x, packed, scale, low, bh, s, 128, 32);
    else if (d == 64 && g == 32)
        int4_enc_keys_f32_body(x, packed, scale, low, bh, s, 64, 32);
    else
        int4_enc_keys_f32_body(x, packed, scale, low, bh, s, d, g);
}

void int4_enc_rows_f32(const float *restrict x, uint8_t *restrict packed, float *restrict scale, float *restrict low, int64_t rows, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_enc_rows_f32_body(x, packed, scale, low, rows, 128, 32);
    else if (d == 64 && g == 32)
        int4_enc_rows_f32_body(x, packed, scale, low, rows, 64, 32);
    else
        int4_enc_rows_f32_body(x, packed, scale, low, rows, d, g);
}

void int4_dec_keys_f32(const uint8_t *restrict packed, const float *restrict scale, const float *restrict low, float *restrict out, int64_t bh, int64_t s, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_dec_keys_f32_body(packed, scale, low, out, bh, s, 128, 32);
    else if (d == 64 && g == 32)
        int4_dec_keys_f32_body(packed, scale, low, out, bh, s, 64, 32);
    else
        int4_dec_keys_f32_body(packed, scale, low, out, bh, s, d, g);
}

void int4_dec_rows_f32(const uint8_t *restrict packed, const float *restrict scale, const float *restrict low, float *restrict out, int64_t rows, int64_t d, int64_t g) {
    if (d == 128 && g == 32)
        int4_dec_rows_f32_body(packed, scale, low, out, rows, 128, 32);
    else if (d == 64 && g == 32)
        int4_dec_rows_f32_body(packed, scale, low, out, rows, 64, 32);
    else
        int4_dec_rows_f32_body(packed, scale, low, out, rows, d, g);
}

/* ---- whole layers: one call for a layer's keys and values, split over the OpenMP threads ------ */

/* The threads share the layer: each takes a run of heads of the keys and a run of rows of the
 * values. The OpenMP runtime is torch's own (its libgomp.so.1 is loaded first, and this library's
 * dependency on libgomp.so.1 resolves to it), so these are the threads torch's ops run on, and
 * torch.set_num_threads sets how many; a layer under PARALLEL_MIN elements runs on one. */
#define PARALLEL_MIN (1 << 15)

static inline void split(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
#else
    int64_t t = 0, k = 1;
#endif
    *lo = n * t / k;
    *hi = n * (t + 1) / k;
}

static inline int64_t nonfinite_bf16(const uint16_t *restrict b, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (b[i] & 0x7F80) == 0x7F80;
    return bad;
}

static inline int64_t nonfinite_f32(const float *restrict f, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (f32_bits(f[i]) & 0x7F800000u) == 0x7F800000u;
    return bad;
}

/* int8 of one [bh, s, d] layer: keys per channel, values per token. Returns 1 when a key scale is
 * not finite (the keys hold NaN or inf), 2 when a value scale is not, 3 for both, else 0. */
#define INT8_ENC_LAYER(SUFFIX, T, S, NONFINITE)                                                               \
    int int8_enc_layer_##SUFFIX(const T *k, const T *v, int8_t *kq, S *ks, int8_t *vq, S *vs, int64_t bh,     \
                                int64_t s, int64_t d) {                                                        \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a) int8_enc_keys_##SUFFIX(k + a * s * d, kq + a * s * d, ks + a * d, b - a, s, d);         \
            if (e > c) int8_enc_rows_##SUFFIX(v + c * d, vq + c * d, vs + c, e - c, d);                        \
        }                                                                                                      \
        return (int)(NONFINITE(ks, bh * d) | (NONFINITE(vs, bh * s) << 1));                                   \
    }

INT8_ENC_LAYER(bf16, uint16_t, uint16_t, nonfinite_bf16)
INT8_ENC_LAYER(f32, float, float, nonfinite_f32)

#define INT8_DEC_LAYER(SUFFIX, S)                                                                              \
    void int8_dec_layer_##SUFFIX(const int8_t *kq, const S *ks, const int8_t *vq, const S *vs, S *ko, S *vo,   \
                                 int64_t bh, int64_t s, int64_t d) {                                           \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a) int8_dec_keys_##SUFFIX(kq + a * s * d, ks + a * d, ko + a * s * d, b - a, s, d);        \
            if (e > c) int8_dec_rows_##SUFFIX(vq + c * d, vs + c, vo + c * d, e - c, d);                       \
        }                                                                                                      \
    }

INT8_DEC_LAYER(bf16, uint16_t)
INT8_DEC_LAYER(f32, float)

/* int4 of one layer: keys in groups of kg tokens, values in groups of vg channels. Returns as
 * int8_enc_layer_bf16. */
#define INT4_ENC_LAYER(SUFFIX, T, NONFINITE)                                                                   \
    int int4_enc_layer_##SUFFIX(const T *k, const T *v, uint8_t *kc, T *ks, T *kl, uint8_t *vc, T *vs, T *vl,  \
                                int64_t bh, int64_t s, int64_t d, int64_t kg, int64_t vg) {                    \
        int64_t groups = (s + kg - 1) / kg, per = d / vg;                                                      \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a)                                                                                         \
                int4_enc_keys_##SUFFIX(k + a * s * d, kc + a * groups * kg * d / 2, ks + a * groups * d,       \
                                       kl + a * groups * d, b - a, s, d, kg);                                  \
            if (e > c)                                                                                         \
                int4_enc_rows_##SUFFIX(v + c * d, vc + c * d / 2, vs + c * per, vl + c * per, e - c, d, vg);   \
        }                                                                                                      \
        return (int)(NONFINITE(ks, bh * groups * d) | (NONFINITE(vs, bh * s * per) << 1));                    \
    }

INT4_ENC_LAYER(bf16, uint16_t, nonfinite_bf16)
INT4_ENC_LAYER(f32, float, nonfinite_f32)

#define INT4_DEC_LAYER(SUFFIX, T)                                                                              \
    void int4_dec_layer_##SUFFIX(const uint8_t *kc, const T *ks, const T *kl, const uint8_t *vc, const T *vs,  \
                                 const T *vl, T *ko, T *vo, int64_t bh, int64_t s, int64_t d, int64_t kg,      \
                                 int64_t vg) {                                                                 \
        int64_t groups = (s + kg - 1) / kg, per = d / vg;                                                      \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a)                                                                                         \
                int4_dec_keys_##SUFFIX(kc + a * groups * kg * d / 2, ks + a * groups * d, kl + a * groups * d, \
                                       ko + a * s * d, b - a, s, d, kg);                                       \
            if (e > c)                                                                                         \
                int4_dec_rows_##SUFFIX(vc + c * d / 2, vs + c * per, vl + c * per, vo + c * d, e - c, d, vg);  \
        }                                                                                                      \
    }

INT4_DEC_LAYER(bf16, uint16_t)
INT4_DEC_LAYER(f32, float)

/* ---- int8 layout 2: keys centred per channel ------------------------------------------------------
 * Per channel of a head: the midpoint of its smallest and largest key (the offset, in the KV dtype,
 * as Int8Codec's torch path rounds it: (lo * 0.5) + hi * 0.5, each step rounded to the dtype; NaN
 * when the channel holds one; 0 for no token), then the keys minus it rounded to the KV dtype
 * (the centred keys), quantised as int8_enc_keys does its keys. Decoding rounds q * scale to the
 * KV dtype, then adds the offset and rounds again, as the torch path's add_ does. */

static inline __attribute__((always_inline)) void int8c_enc_keys_bf16_body(const uint16_t *restrict x, int8_t *restrict q, uint16_t *restrict scale,
                        uint16_t *restrict off, int64_t bh, int64_t s, int64_t d) {
    float lo[CHUNK], hi[CHUNK], mid[CHUNK], sc[CHUNK], rc[CHUNK], f[CHUNK];
    uint16_t am[CHUNK];
    int nan[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const uint16_t *xr = x + r * s * d;
        for (int64_t c = 0; c < d; c++) {
            lo[c] = INFINITY;
            hi[c] = -INFINITY;
            nan[c] = 0;
            am[c] = 0;
        }
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                float v = bf16_to_f32(xr[t * d + c]);
                nan[c] |= v != v;
                lo[c] = v < lo[c] ? v : lo[c];
                hi[c] = v > hi[c] ? v : hi[c];
            }
        for (int64_t c = 0; c < d; c++) {
            float half = bf16_to_f32(f32_to_bf16(lo[c] * 0.5f));
            uint16_t m = s == 0 ? 0 : nan[c] ? (uint16_t)0x7FC0 : f32_to_bf16(half + hi[c] * 0.5f);
            off[r * d + c] = m;
            mid[c] = bf16_to_f32(m);
        }
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                uint16_t a = f32_to_bf16(bf16_to_f32(xr[t * d + c]) - mid[c]) & 0x7FFF;
                am[c] = a > am[c] ? a : am[c];
            }
        for (int64_t c = 0; c < d; c++) {
            uint16_t b = scale[r * d + c] = int8_scale_bf16(am[c]);
            sc[c] = bf16_to_f32(b);
            rc[c] = 1.0f / sc[c];
        }
        for (int64_t t = 0; t < s; t++) {
            for (int64_t c = 0; c < d; c++) f[c] = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[t * d + c]) - mid[c]));
            codes_vec(f, sc, rc, (uint8_t *)q + (r * s + t) * d, d);
        }
    }
}

static inline __attribute__((always_inline)) void int8c_enc_keys_f32_body(const float *restrict x, int8_t *restrict q, float *restrict scale,
                        float *restrict off, int64_t bh, int64_t s, int64_t d) {
    float lo[CHUNK], hi[CHUNK], mid[CHUNK], sc[CHUNK], rc[CHUNK], f[CHUNK];
    uint32_t am[CHUNK];
    int nan[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        const float *xr = x + r * s * d;
        for (int64_t c = 0; c < d; c++) {
            lo[c] = INFINITY;
            hi[c] = -INFINITY;
            nan[c] = 0;
            am[c] = 0;
        }
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                float v = xr[t * d + c];
                nan[c] |= v != v;
                lo[c] = v < lo[c] ? v : lo[c];
                hi[c] = v > hi[c] ? v : hi[c];
            }
        for (int64_t c = 0; c < d; c++) {
            float m = s == 0 ? 0.0f : nan[c] ? NAN : lo[c] * 0.5f + hi[c] * 0.5f;
            off[r * d + c] = m;
            mid[c] = m;
        }
        for (int64_t t = 0; t < s; t++)
            for (int64_t c = 0; c < d; c++) {
                uint32_t a = f32_bits(xr[t * d + c] - mid[c]) & 0x7FFFFFFFu;
                am[c] = a > am[c] ? a : am[c];
            }
        for (int64_t c = 0; c < d; c++) {
            sc[c] = scale[r * d + c] = int8_scale_f32(am[c]);
            rc[c] = 1.0f / sc[c];
        }
        for (int64_t t = 0; t < s; t++) {
            for (int64_t c = 0; c < d; c++) f[c] = xr[t * d + c] - mid[c];
            codes_vec(f, sc, rc, (uint8_t *)q + (r * s + t) * d, d);
        }
    }
}

static inline __attribute__((always_inline)) void int8c_dec_keys_bf16_body(const int8_t *restrict q, const uint16_t *restrict scale, const uint16_t *restrict off,
                        uint16_t *restrict out, int64_t bh, int64_t s, int64_t d) {
    float sc[CHUNK], mid[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t c = 0; c < d; c++) {
            sc[c] = bf16_to_f32(scale[r * d + c]);
            mid[c] = bf16_to_f32(off[r * d + c]);
        }
        for (int64_t t = 0; t < s; t++) {
            const int8_t *in = q + (r * s + t) * d;
            uint16_t *o = out + (r * s + t) * d;
            for (int64_t c = 0; c < d; c++) o[c] = f32_to_bf16(bf16_to_f32(f32_to_bf16((float)in[c] * sc[c])) + mid[c]);
        }
    }
}

static inline __attribute__((always_inline)) void int8c_dec_keys_f32_body(const int8_t *restrict q, const float *restrict scale, const float *restrict off,
                        float *restrict out, int64_t bh, int64_t s, int64_t d) {
    float sc[CHUNK], mid[CHUNK];
    for (int64_t r = 0; r < bh; r++) {
        for (int64_t c = 0; c < d; c++) {
            sc[c] = scale[r * d + c];
            mid[c] = off[r * d + c];
        }
        for (int64_t t = 0; t < s; t++) {
            const int8_t *in = q + (r * s + t) * d;
            float *o = out + (r * s + t) * d;
            for (int64_t c = 0; c < d; c++) o[c] = (float)in[c] * sc[c] + mid[c];
        }
    }
}

static void int8c_enc_keys_bf16(const uint16_t *x, int8_t *q, uint16_t *scale, uint16_t *off, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8c_enc_keys_bf16_body(x, q, scale, off, bh, s, 128);
    else if (d == 64)
        int8c_enc_keys_bf16_body(x, q, scale, off, bh, s, 64);
    else
        int8c_enc_keys_bf16_body(x, q, scale, off, bh, s, d);
}

static void int8c_enc_keys_f32(const float *x, int8_t *q, float *scale, float *off, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8c_enc_keys_f32_body(x, q, scale, off, bh, s, 128);
    else if (d == 64)
        int8c_enc_keys_f32_body(x, q, scale, off, bh, s, 64);
    else
        int8c_enc_keys_f32_body(x, q, scale, off, bh, s, d);
}

static void int8c_dec_keys_bf16(const int8_t *q, const uint16_t *scale, const uint16_t *off, uint16_t *out, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8c_dec_keys_bf16_body(q, scale, off, out, bh, s, 128);
    else if (d == 64)
        int8c_dec_keys_bf16_body(q, scale, off, out, bh, s, 64);
    else
        int8c_dec_keys_bf16_body(q, scale, off, out, bh, s, d);
}

static void int8c_dec_keys_f32(const int8_t *q, const float *scale, const float *off, float *out, int64_t bh, int64_t s, int64_t d) {
    if (d == 128)
        int8c_dec_keys_f32_body(q, scale, off, out, bh, s, 128);
    else if (d == 64)
        int8c_dec_keys_f32_body(q, scale, off, out, bh, s, 64);
    else
        int8c_dec_keys_f32_body(q, scale, off, out, bh, s, d);
}

/* int8 layout 2 of one layer: returns as int8_enc_layer_bf16 (an offset that is NaN makes its
 * channel's centred keys, hence its scale, NaN). */
#define INT8C_ENC_LAYER(SUFFIX, T, S, NONFINITE)                                                              \
    int int8c_enc_layer_##SUFFIX(const T *k, const T *v, int8_t *kq, S *ks, S *ko, int8_t *vq, S *vs,         \
                                 int64_t bh, int64_t s, int64_t d) {                                           \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a) int8c_enc_keys_##SUFFIX(k + a * s * d, kq + a * s * d, ks + a * d, ko + a * d, b - a, s, d); \
            if (e > c) int8_enc_rows_##SUFFIX(v + c * d, vq + c * d, vs + c, e - c, d);                        \
        }                                                                                                      \
        return (int)(NONFINITE(ks, bh * d) | (NONFINITE(vs, bh * s) << 1));                                   \
    }

INT8C_ENC_LAYER(bf16, uint16_t, uint16_t, nonfinite_bf16)
INT8C_ENC_LAYER(f32, float, float, nonfinite_f32)

#define INT8C_DEC_LAYER(SUFFIX, S)                                                                             \
    void int8c_dec_layer_##SUFFIX(const int8_t *kq, const S *ks, const S *kf, const int8_t *vq, const S *vs,   \
                                  S *ko, S *vo, int64_t bh, int64_t s, int64_t d) {                            \
        _Pragma("omp parallel if (bh * s * d >= PARALLEL_MIN)") {                                              \
            int64_t a, b, c, e;                                                                                \
            split(bh, &a, &b);                                                                                 \
            split(bh * s, &c, &e);                                                                             \
            if (b > a) int8c_dec_keys_##SUFFIX(kq + a * s * d, ks + a * d, kf + a * d, ko + a * s * d, b - a, s, d); \
            if (e > c) int8_dec_rows_##SUFFIX(vq + c * d, vs + c, vo + c * d, e - c, d);                       \
        }                                                                                                      \
    }

INT8C_DEC_LAYER(bf16, uint16_t)
INT8C_DEC_LAYER(f32, float)
