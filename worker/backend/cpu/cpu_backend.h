/* The cpu backend constructor; everything else goes through the ops table. */
#ifndef DIT_BACKEND_CPU_BACKEND_H
#define DIT_BACKEND_CPU_BACKEND_H

#include "backend/backend.h"

/* n_threads: OpenMP/OpenBLAS threads this backend uses; 0 = online cores. */
dit_status dit_cpu_backend_create(int n_threads, dit_backend **out, dit_diag *diag);

#endif
