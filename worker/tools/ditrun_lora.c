/* ditrun --lora: the adapters of the command line, loaded against the
 * transformer this rank holds and attached for every forward of the run. */
#include <stdio.h>

#include "parallel/lora.h"
#include "tools/ditrun.h"

dit_status ditrun_attach_loras(const ditrun_args *a, dit_backend *be, dit_lora_sites *sites,
                               dit_lora **loras, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_lora_use uses[DITRUN_MAX_LORA];
    if (a->n_lora == 0)
        return DIT_OK;
    if (!sites)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "this model takes no LoRA adapters");
    for (int i = 0; i < a->n_lora; i++) {
        DIT_CHECK(dit_lora_load(be, sites, a->lora_path[i], 0, &loras[i], diag));
        uses[i].lora = loras[i];
        uses[i].scale = a->lora_scale[i];
    }
    if (a->fuse_lora) {
        /* Merged for good; the adapters stay loaded for the report. */
        for (int i = 0; i < a->n_lora; i++)
            DIT_CHECK(dit_lora_fuse(sites, loras[i], a->lora_scale[i], diag));
        return DIT_OK;
    }
    DIT_CHECK(dit_lora_attach(sites, uses, a->n_lora, diag));
cleanup:
    return st;
}
