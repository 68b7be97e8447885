#include "core/tensor.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

size_t dit_dtype_size(dit_dtype dt)
{
    switch (dt) {
    case DIT_F32:
        return 4;
    case DIT_BF16:
    case DIT_F16:
        return 2;
    case DIT_F8_E4M3:
        return 1;
    default:
        return 0;
    }
}

const char *dit_dtype_name(dit_dtype dt)
{
    switch (dt) {
    case DIT_F32:
        return "f32";
    case DIT_BF16:
        return "bf16";
    case DIT_F16:
        return "f16";
    case DIT_F8_E4M3:
        return "f8_e4m3";
    default:
        return "invalid";
    }
}

dit_tensor dit_tensor_make(void *data, dit_dtype dt, int ndim, const int64_t *shape)
{
    assert(ndim >= 0 && ndim <= DIT_MAX_DIMS);
    dit_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dt;
    t.ndim = ndim;
    t.data = data;
    int64_t stride = (int64_t)dit_dtype_size(dt);
    for (int i = ndim - 1; i >= 0; i--) {
        t.ne[i] = shape[i];
        t.nb[i] = stride;
        /* A shape too large for memory (which callers check for with
         * dit_tensor_numel) must not overflow here: saturate. */
        if (__builtin_mul_overflow(stride, shape[i], &stride))
            stride = INT64_MAX;
    }
    return t;
}

dit_tensor dit_tensor_1d(void *data, dit_dtype dt, int64_t n0)
{
    int64_t s[1] = {n0};
    return dit_tensor_make(data, dt, 1, s);
}

dit_tensor dit_tensor_2d(void *data, dit_dtype dt, int64_t n0, int64_t n1)
{
    int64_t s[2] = {n0, n1};
    return dit_tensor_make(data, dt, 2, s);
}

dit_tensor dit_tensor_3d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2)
{
    int64_t s[3] = {n0, n1, n2};
    return dit_tensor_make(data, dt, 3, s);
}

dit_tensor dit_tensor_4d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3)
{
    int64_t s[4] = {n0, n1, n2, n3};
    return dit_tensor_make(data, dt, 4, s);
}

dit_tensor dit_tensor_5d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                         int64_t n4)
{
    int64_t s[5] = {n0, n1, n2, n3, n4};
    return dit_tensor_make(data, dt, 5, s);
}

int64_t dit_tensor_numel(const dit_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->ne[i];
    return n;
}

size_t dit_tensor_nbytes(const dit_tensor *t)
{
    return (size_t)dit_tensor_numel(t) * dit_dtype_size(t->dtype);
}

bool dit_tensor_is_contiguous(const dit_tensor *t)
{
    int64_t stride = (int64_t)dit_dtype_size(t->dtype);
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->ne[i] != 1 && t->nb[i] != stride)
            return false;
        stride *= t->ne[i];
    }
    return true;
}

bool dit_tensor_rows_dense(const dit_tensor *t)
{
    return t->ndim == 0 || t->ne[t->ndim - 1] == 1 ||
           t->nb[t->ndim - 1] == (int64_t)dit_dtype_size(t->dtype);
}

int64_t dit_tensor_row_stride(const dit_tensor *t)
{
    if (t->ndim <= 1)
        return 0;
    /* Walk the row dims from the innermost outwards: each dim of size > 1
     * must step by exactly the span of the dims inside it. */
    int64_t stride = -1, span = 1;
    for (int i = t->ndim - 2; i >= 0; i--) {
        if (t->ne[i] == 1)
            continue;
        if (stride < 0)
            stride = t->nb[i];
        else if (t->nb[i] != stride * span)
            return -1;
        span *= t->ne[i];
    }
    return stride < 0 ? 0 : stride;
}

int64_t dit_tensor_nrows(const dit_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim - 1; i++)
        n *= t->ne[i];
    return n;
}

int64_t dit_tensor_row_offset(const dit_tensor *t, int64_t r)
{
    int64_t off = 0;
    for (int i = t->ndim - 2; i >= 0; i--) {
        off += (r % t->ne[i]) * t->nb[i];
        r /= t->ne[i];
    }
    return off;
}

bool dit_tensor_same_shape(const dit_tensor *a, const dit_tensor *b)
{
    if (a->ndim != b->ndim)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->ne[i] != b->ne[i])
            return false;
    return true;
}

dit_tensor dit_tensor_narrow(const dit_tensor *t, int dim, int64_t start, int64_t len)
{
    assert(dim >= 0 && dim < t->ndim);
    dit_tensor v = *t;
    v.data = (char *)t->data + start * t->nb[dim];
    v.ne[dim] = len;
    return v;
}

dit_tensor dit_tensor_split_last(const dit_tensor *t, int64_t inner)
{
    assert(t->ndim >= 1 && t->ndim < DIT_MAX_DIMS);
    dit_tensor v = *t;
    int last = t->ndim - 1;
    v.ndim = t->ndim + 1;
    v.ne[last] = t->ne[last] / inner;
    v.nb[last] = t->nb[last] * inner;
    v.ne[last + 1] = inner;
    v.nb[last + 1] = t->nb[last];
    return v;
}

void dit_tensor_shape_str(const dit_tensor *t, char *buf, size_t cap)
{
    size_t used = 0;
    int n = snprintf(buf, cap, "(");
    used = n > 0 ? (size_t)n : 0;
    for (int i = 0; i < t->ndim && used < cap; i++) {
        n = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)t->ne[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    if (used < cap)
        snprintf(buf + used, cap - used, ") %s", dit_dtype_name(t->dtype));
}

float dit_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t dit_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + rounding) >> 16);
}

float dit_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            man &= 0x3ffu;
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t dit_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u)
        return sign | 0x7e00u;
    if (absu >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return sign | 0x7c00u;
    if (absu < 0x38800000u) { /* below the smallest normal half */
        /* Scale into the subnormal range and let the FPU round to nearest
         * even: 2^-24 is the half subnormal step. */
        float a;
        memcpy(&a, &absu, sizeof a);
        float scaled = a * 16777216.0f; /* / 2^-24 */
        uint32_t m = (uint32_t)lrintf(scaled);
        return sign | (uint16_t)m;
    }
    uint32_t rounding = 0xfffu + ((absu >> 13) & 1u);
    absu += rounding;
    return sign | (uint16_t)(((absu >> 13) - ((127 - 15) << 10)) & 0x7fffu);
}

float dit_f8e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu;
    uint32_t man = b & 0x7u;
    uint32_t u;
    if (exp == 0xf && man == 0x7) {
        u = sign | 0x7ff00000u; /* the only NaN; no infinities */
    } else if (exp == 0) {
        /* Zero or subnormal: man * 2^-9, exact in f32. */
        float f = (float)man * 0x1p-9f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else {
        /* Rebias the exponent from 7 to 127; the mantissa moves up 20 bits. */
        u = sign | ((exp + 127 - 7) << 23) | (man << 20);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint8_t dit_f32_to_f8e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t absu = u & 0x7fffffffu;
    /* From 480 (0x43f00000) up, infinity and NaN included, the result is
     * NaN, as in PyTorch. Below it, values in (464, 480) round up into
     * S.1111.111 further down, which is NaN as well; 464 itself ties to the
     * even 448. */
    if (absu >= 0x43f00000u)
        return sign | 0x7fu;
    if (absu < 0x3c800000u) { /* below 2^-6, the smallest normal */
        /* Scale into units of the subnormal step 2^-9 (exact) and let the
         * FPU round to nearest even; 8 steps is 2^-6, whose encoding 0x08
         * is the same number. */
        float a;
        memcpy(&a, &absu, sizeof a);
        return sign | (uint8_t)lrintf(a * 512.0f);
    }
    /* Round the 23-bit mantissa to 3 bits, to nearest even; a carry moves
     * into the exponent as it should. */
    absu += 0x7ffffu + ((absu >> 20) & 1u);
    return sign | (uint8_t)((absu >> 20) - ((127u - 7u) << 3));
}

/* Element loads and stores go through memcpy: safetensors data may sit at
 * any byte offset, so a uint16_t pointer into it can be misaligned. */
static inline uint16_t load_u16(const void *p, size_t i)
{
    uint16_t v;
    memcpy(&v, (const char *)p + 2 * i, sizeof v);
    return v;
}

static inline float load_f32(const float *p, size_t i)
{
    float v;
    memcpy(&v, (const char *)p + 4 * i, sizeof v);
    return v;
}

static inline void store_u16(void *p, size_t i, uint16_t v)
{
    memcpy((char *)p + 2 * i, &v, sizeof v);
}

void dit_convert_to_f32(float *dst, const void *src, dit_dtype st, size_t n)
{
    switch (st) {
    case DIT_F32:
        memmove(dst, src, n * sizeof(float));
        break;
    case DIT_BF16:
        for (size_t i = 0; i < n; i++)
            dst[i] = dit_bf16_to_f32(load_u16(src, i));
        break;
    case DIT_F16:
        for (size_t i = 0; i < n; i++)
            dst[i] = dit_f16_to_f32(load_u16(src, i));
        break;
    case DIT_F8_E4M3:
        for (size_t i = 0; i < n; i++)
            dst[i] = dit_f8e4m3_to_f32(((const uint8_t *)src)[i]);
        break;
    default:
        break;
    }
}

void dit_convert_from_f32(void *dst, dit_dtype dt, const float *src, size_t n)
{
    switch (dt) {
    case DIT_F32:
        memmove(dst, src, n * sizeof(float));
        break;
    case DIT_BF16:
        for (size_t i = 0; i < n; i++)
            store_u16(dst, i, dit_f32_to_bf16(load_f32(src, i)));
        break;
    case DIT_F16:
        for (size_t i = 0; i < n; i++)
            store_u16(dst, i, dit_f32_to_f16(load_f32(src, i)));
        break;
    case DIT_F8_E4M3:
        for (size_t i = 0; i < n; i++)
            ((uint8_t *)dst)[i] = dit_f32_to_f8e4m3(load_f32(src, i));
        break;
    default:
        break;
    }
}

void dit_convert_scaled(void *dst, dit_dtype dt, const void *src, dit_dtype st, size_t n,
                        float scale)
{
    /* Through f32 in blocks small enough for the stack. */
    enum { BLOCK = 256 };
    float tmp[BLOCK];
    const size_t se = dit_dtype_size(st), de = dit_dtype_size(dt);
    for (size_t i = 0; i < n; i += BLOCK) {
        size_t m = n - i < BLOCK ? n - i : BLOCK;
        dit_convert_to_f32(tmp, (const char *)src + i * se, st, m);
        if (scale != 1.0f)
            for (size_t j = 0; j < m; j++)
                tmp[j] *= scale;
        dit_convert_from_f32((char *)dst + i * de, dt, tmp, m);
    }
}
