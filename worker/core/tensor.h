/* Tensor views: dtype, shape (up to 5 dims), byte strides and a data pointer.
 *
 * A dit_tensor is a plain value type (a view): it does not own memory. Memory
 * comes from a backend allocation (weights, arenas) or, for host tensors, from
 * the caller (an mmap of a safetensors file, a malloc). Shapes are written
 * outermost first, as PyTorch writes them: a (B, S, H, D) tensor has
 * ne = {B, S, H, D} and, when contiguous, nb = {S*H*D*e, H*D*e, D*e, e} where
 * e is the element size in bytes.
 *
 * Owner: whoever owns the memory the view points into. */
#ifndef DIT_CORE_TENSOR_H
#define DIT_CORE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DIT_F8_E4M3 is torch.float8_e4m3fn (safetensors "F8_E4M3"): 1 sign bit, 4
 * exponent bits with bias 7, 3 mantissa bits, subnormals, no infinities;
 * S.1111.111 is NaN, so the largest finite value is 448. It is a storage
 * dtype: loaders read and convert it, no op computes in it. */
typedef enum dit_dtype { DIT_F32 = 0, DIT_BF16, DIT_F16, DIT_F8_E4M3, DIT_DTYPE_COUNT } dit_dtype;

/* Five dims hold a video latent (B, C, F, H, W). Ops defined on fewer dims
 * refuse more with a status. */
#define DIT_MAX_DIMS 5

typedef struct dit_tensor {
    dit_dtype dtype;
    int ndim;
    int64_t ne[DIT_MAX_DIMS]; /* elements per dim, outermost first */
    int64_t nb[DIT_MAX_DIMS]; /* stride per dim in bytes */
    void *data;
} dit_tensor;

size_t dit_dtype_size(dit_dtype dt);
const char *dit_dtype_name(dit_dtype dt);

/* A contiguous view of `ndim` dims over `data`. */
dit_tensor dit_tensor_make(void *data, dit_dtype dt, int ndim, const int64_t *shape);

/* Shorthands for contiguous views. */
dit_tensor dit_tensor_1d(void *data, dit_dtype dt, int64_t n0);
dit_tensor dit_tensor_2d(void *data, dit_dtype dt, int64_t n0, int64_t n1);
dit_tensor dit_tensor_3d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2);
dit_tensor dit_tensor_4d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3);
dit_tensor dit_tensor_5d(void *data, dit_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                         int64_t n4);

int64_t dit_tensor_numel(const dit_tensor *t);

/* Bytes spanned by a contiguous tensor of this shape. */
size_t dit_tensor_nbytes(const dit_tensor *t);

bool dit_tensor_is_contiguous(const dit_tensor *t);

/* True when the innermost dim has unit stride (rows are dense). */
bool dit_tensor_rows_dense(const dit_tensor *t);

/* The byte distance between consecutive rows (all dims but the innermost,
 * flattened) when it is the same for every pair of rows, so that row r
 * starts at data + r * stride: true of contiguous tensors and of column
 * slices of them, false of head views of a fused projection (B, S, H, D)
 * taken from (B, S, 3 H D). Returns -1 when the rows are not evenly spaced,
 * 0 when there is at most one row. Kernels use it to skip a div/rem per
 * outer dim. */
int64_t dit_tensor_row_stride(const dit_tensor *t);

/* Rows are all dims but the innermost, flattened outermost first: a (B, S, C)
 * tensor has B*S rows of C elements; a 1-D or 0-D tensor has one row. */
int64_t dit_tensor_nrows(const dit_tensor *t);

/* Byte offset from t->data to the first element of row r, for any strides
 * and any rank up to DIT_MAX_DIMS. */
int64_t dit_tensor_row_offset(const dit_tensor *t, int64_t r);

bool dit_tensor_same_shape(const dit_tensor *a, const dit_tensor *b);

/* View of elements [start, start+len) along `dim`; the caller guarantees the
 * range is inside the tensor. */
dit_tensor dit_tensor_narrow(const dit_tensor *t, int dim, int64_t start, int64_t len);

/* Splits the last dim of a view into (n_outer, inner) where
 * n_outer * inner == ne[last]: (B, S, H*D) -> (B, S, H, D). */
dit_tensor dit_tensor_split_last(const dit_tensor *t, int64_t inner);

/* Prints "(2, 3, 4) f32" into buf. */
void dit_tensor_shape_str(const dit_tensor *t, char *buf, size_t cap);

/* Scalar conversions used by loaders and the CPU backend. Round to nearest
 * even, the way PyTorch converts. */
float dit_bf16_to_f32(uint16_t h);
uint16_t dit_f32_to_bf16(float f);
float dit_f16_to_f32(uint16_t h);
uint16_t dit_f32_to_f16(float f);

/* E4M3 to f32 is exact; NaN (S.1111.111) becomes a quiet NaN of the same
 * sign (0x7ff00000 | sign, as PyTorch gives). */
float dit_f8e4m3_to_f32(uint8_t b);

/* f32 to E4M3, rounding to nearest even exactly as PyTorch's
 * x.to(torch.float8_e4m3fn) does, overflow included: E4M3 has no infinity,
 * and a magnitude that rounds past 448 (above 464, the midpoint between 448
 * and the absent 480), an infinity or a NaN gives NaN (0x7f | sign), not
 * 448. Code that wants the saturating conversion of FP8 quantisers (and of
 * CUDA's __NV_SATFINITE) clamps to [-448, 448] first. */
uint8_t dit_f32_to_f8e4m3(float f);

/* Largest finite E4M3 magnitude. */
#define DIT_F8_E4M3_MAX 448.0f

/* Converts `n` elements from `src` of dtype `st` to f32. */
void dit_convert_to_f32(float *dst, const void *src, dit_dtype st, size_t n);

/* Converts `n` f32 elements to dtype `dt`. */
void dit_convert_from_f32(void *dst, dit_dtype dt, const float *src, size_t n);

/* dst = dt(f32(src) * scale) for `n` dense elements: the dequantisation of
 * FP8 checkpoints, whose tensors carry a per-tensor scale (`weight_scale`).
 * The product is taken in f32 and rounded once to dt; scale 1 gives exactly
 * the plain conversion. Any dtypes; dst and src must not overlap. */
void dit_convert_scaled(void *dst, dit_dtype dt, const void *src, dit_dtype st, size_t n,
                        float scale);

#ifdef __cplusplus
}
#endif

#endif
