/* CPU kernels of the block-wise quantizer: see native.py (why they exist, how they are built) and quantize.py
 * (the format and the eager PyTorch reference they match bitwise, signed zeros of all-zero blocks aside).
 *
 * Plain C11 plus GCC/Clang vector extensions, no headers beyond libc: it compiles in well under a second with
 * the system compiler, and every loop below vectorises (AVX2/AVX-512 on x86, NEON on Arm) without -ffast-math,
 * so NaN and rounding semantics are IEEE's. One call processes whole blocks in one pass over memory.
 */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_BLOCK 4096
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds half to even for |v| < 2^22 */
#define FLOAT_MAX 3.40282347e+38f

#ifdef __FMA__ /* torch's vectorised add_(b, alpha=a) is one fused multiply-add per value where the CPU has one */
#define MULADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MULADD(a, b, c) ((a) * (b) + (c))
#endif

typedef int32_t vi32 __attribute__((vector_size(4 * LANES)));

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* max |x| over a block, NaN if it holds a NaN. On the bit patterns: for non-NaN floats |x| orders like its bits,
 * and integer max vectorises without fast-math (a float max with NaN semantics does not). */
static inline float block_absmax(const float *x, int n) {
    vi32 top = {0}, nan = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES) {
        vi32 bits;
        memcpy(&bits, x + j, sizeof bits);
        vi32 a = bits & 0x7FFFFFFF;
        nan |= a > 0x7F800000;
        vi32 greater = a > top;
        top = (a & greater) | (top & ~greater);
    }
    int32_t best = 0, any_nan = 0;
    for (int l = 0; l < LANES; l++) {
        best = top[l] > best ? top[l] : best;
        any_nan |= nan[l];
    }
    for (; j < n; j++) {
        int32_t a;
        memcpy(&a, x + j, 4);
        a &= 0x7FFFFFFF;
        any_nan |= a > 0x7F800000;
        best = a > best ? a : best;
    }
    if (any_nan) best = 0x7FC00000;
    float out;
    memcpy(&out, &best, 4);
    return out;
}

/* x: nblocks * block floats. residual: NULL or nblocks * block floats (may be x itself), receives x - q * scale,
 * or, with accumulate, residual += alpha * (x - q * scale) (as torch's add_(e, alpha=...), fused when the CPU has
 * FMA). codes: nblocks * block * bits / 8 bytes. scales: nblocks bfloat16 bit patterns. */
void lds_quantize(const float *x, float *residual, uint8_t *codes, uint16_t *scales, int64_t nblocks, int32_t block,
                  int32_t bits, int32_t accumulate, float alpha) {
    const float limit = (float)((1 << (bits - 1)) - 1);
    float y[MAX_BLOCK];
    int8_t q[MAX_BLOCK];
    for (int64_t b = 0; b < nblocks; b++) {
        const float *xb = x + b * block;
        uint16_t scale = to_bf16(block_absmax(xb, block) / limit);
        scales[b] = scale;
        const float step = from_bf16(scale);
        /* Zero and non-finite scales give 0 (codes of non-finite blocks are unspecified: they dequantize to
         * non-finite values through their scale); a subnormal scale's reciprocal is capped to stay finite. */
        float inverse = step > 0.0f ? 1.0f / step : 0.0f;
        inverse = inverse > FLOAT_MAX ? FLOAT_MAX : inverse;
        for (int j = 0; j < block; j++) {
            float v = xb[j] * inverse;
            v = (v + ROUND_MAGIC) - ROUND_MAGIC;
            v = v > limit ? limit : v;
            v = v < -limit ? -limit : v;
            y[j] = v == v ? v : 0.0f;
        }
        if (bits == 8) {
            int8_t *out = (int8_t *)codes + b * block;
            for (int j = 0; j < block; j++) out[j] = (int8_t)(int32_t)y[j];
        } else {
            /* Two codes per byte, the even value in the low nibble, each offset by 8: read the int8 codes as
             * little-endian pairs, keep both low nibbles, fold the high one down, XOR 0x88 adds the offsets. */
            for (int j = 0; j < block; j++) q[j] = (int8_t)(int32_t)y[j];
            uint8_t *out = codes + b * (block / 2);
            for (int j = 0; j < block / 2; j++) {
                uint16_t pair = (uint16_t)(((uint16_t)(uint8_t)q[2 * j] | ((uint16_t)(uint8_t)q[2 * j + 1] << 8)) &
                                           0x0F0F);
                out[j] = (uint8_t)((pair | (pair >> 4)) ^ 0x88);
            }
        }
        if (residual && !accumulate) {
            float *rb = residual + b * block;
            for (int j = 0; j < block; j++) rb[j] = xb[j] - y[j] * step; /* y * step is exact in fp32 */
        } else if (residual) {
            float *rb = residual + b * block;
            for (int j = 0; j < block; j++) rb[j] = MULADD(xb[j] - y[j] * step, alpha, rb[j]);
        }
    }
}

static inline void dequantize_block(const uint8_t *codes, float step, float *out, int32_t block, int32_t bits,
                                    int32_t accumulate) {
    if (bits == 8) {
        const int8_t *c = (const int8_t *)codes;
        if (accumulate)
            for (int j = 0; j < block; j++) out[j] += (float)c[j] * step;
        else
            for (int j = 0; j < block; j++) out[j] = (float)c[j] * step;
        return;
    }
    float v[MAX_BLOCK];
    for (int j = 0; j < block / 2; j++) {
        v[2 * j] = (float)((int32_t)(codes[j] & 15) - 8);
        v[2 * j + 1] = (float)((int32_t)(codes[j] >> 4) - 8);
    }
    if (accumulate)
        for (int j = 0; j < block; j++) out[j] += v[j] * step;
    else
        for (int j = 0; j < block; j++) out[j] = v[j] * step;
}

/* out[i] (+)= code[i] * scale of its block, for nblocks blocks. */
void lds_dequantize(const uint8_t *codes, const uint16_t *scales, float *out, int64_t nblocks, int32_t block,
                    int32_t bits, int32_t accumulate) {
    const int64_t block_bytes = (int64_t)block * bits / 8;
    for (int64_t b = 0; b < nblocks; b++)
        dequantize_block(codes + b * block_bytes, from_bf16(scales[b]), out + b * block, block, bits, accumulate);
}

/* out[0..count) = the average of values [first, first + count) of nrows quantized rows (codes[r] and scales[r]
 * from each row's start): row 0 dequantized, the others added in order, divided by nrows (as the eager path:
 * dequantize, dequantize(accumulate=True) per further row, div_). Writes a gradient straight from the received
 * messages, whatever its offset in the blocks; nrows = 1 is a plain dequantize of the range. */
void lds_average_range(const uint8_t *const *codes, const uint16_t *const *scales, int32_t nrows, float *out,
                       int64_t first, int64_t count, int32_t block, int32_t bits) {
    const int64_t block_bytes = (int64_t)block * bits / 8, end = first + count;
    const float divisor = (float)nrows, inverse = 1.0f / divisor;
    const int exact = (nrows & (nrows - 1)) == 0; /* x * (1/n) is x / n, bitwise, for n a power of two */
    float acc[MAX_BLOCK];
    for (int64_t b = first / block; b * block < end; b++) {
        const int64_t lo = b * block > first ? b * block : first, hi = (b + 1) * block < end ? (b + 1) * block : end;
        float *dst = hi - lo == block ? out + (lo - first) : acc;
        for (int32_t r = 0; r < nrows; r++)
            dequantize_block(codes[r] + b * block_bytes, from_bf16(scales[r][b]), dst, block, bits, r > 0);
        if (nrows > 1 && exact)
            for (int j = 0; j < block; j++) dst[j] = dst[j] * inverse;
        else if (nrows > 1)
            for (int j = 0; j < block; j++) dst[j] = dst[j] / divisor;
        if (dst == acc)
            memcpy(out + (lo - first), acc + (lo - b * block), (size_t)(hi - lo) * sizeof(float));
    }
}
