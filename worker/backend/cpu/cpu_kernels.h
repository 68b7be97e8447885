/* The cpu backend's kernels: the ops-table entries that cpu_ops.c,
 * cpu_attention.c and cpu_conv.c define, for one kernel set.
 *
 * Those three files are compiled once with the build's own flags (its
 * -march) and, on x86-64 with GCC, again for x86-64-v3 and x86-64-v4
 * (worker/meson.build, which defines DIT_CPU_KERNEL_SUFFIX _x86_64_v3 or
 * _x86_64_v4 for them), so that a build for any x86-64 (the container
 * image's) runs its loops at the vector width of the CPU it meets;
 * cpu_backend.c picks the set (dit_cpu_kernels_pick). Each compilation
 * names its entry points DIT_CPU_KERNEL(op): dit_cpu_<op> for the build's
 * own set, dit_cpu_<op><suffix> for the others.
 *
 * No include guard, on purpose: this header declares the set that
 * DIT_CPU_KERNEL names where it is included, and cpu_backend.c includes it
 * once per set. */
#include "backend/backend.h"

dit_status DIT_CPU_KERNEL(linear)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                  const dit_tensor *w, const dit_tensor *bias, dit_act act,
                                  float beta);
dit_status DIT_CPU_KERNEL(activate)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                    dit_act act);
dit_status DIT_CPU_KERNEL(layer_norm_mod)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                          const dit_tensor *shift, const dit_tensor *scale,
                                          float eps);
dit_status DIT_CPU_KERNEL(rms_norm_rope)(dit_backend *be, const dit_tensor *x,
                                         const dit_tensor *weight, float eps, const dit_tensor *cos,
                                         const dit_tensor *sin);
dit_status DIT_CPU_KERNEL(gated_add)(dit_backend *be, const dit_tensor *res, const dit_tensor *x,
                                     const dit_tensor *gate);
dit_status DIT_CPU_KERNEL(attention)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                                     const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                     float scale);
dit_status DIT_CPU_KERNEL(attention_masked)(dit_backend *be, const dit_tensor *out,
                                            const dit_tensor *q, const dit_tensor *k,
                                            const dit_tensor *v, float scale,
                                            const dit_tensor *bias, bool causal);
dit_status DIT_CPU_KERNEL(layer_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *weight, const dit_tensor *bias, float eps);
dit_status DIT_CPU_KERNEL(rms_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                    const dit_tensor *weight, float eps);
dit_status DIT_CPU_KERNEL(relative_bias)(dit_backend *be, const dit_tensor *y,
                                         const dit_tensor *table, const int32_t *buckets);
dit_status DIT_CPU_KERNEL(embedding)(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                                     const int32_t *ids, int64_t n);
dit_status DIT_CPU_KERNEL(conv2d)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                  const dit_tensor *w, const dit_tensor *bias, int stride, int pad);
dit_status DIT_CPU_KERNEL(group_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *weight, const dit_tensor *bias, int groups,
                                      float eps, dit_act act);
dit_status DIT_CPU_KERNEL(upsample2x)(dit_backend *be, const dit_tensor *y, const dit_tensor *x);
dit_status DIT_CPU_KERNEL(lse_merge)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                                     const dit_tensor *out_b, const dit_tensor *lse_b);
