#include "comm/comm.h"

dit_status dit_comm_sendrecv(dit_comm *c, const void *send, size_t send_bytes, int dst, void *recv,
                             size_t recv_bytes, int src, dit_diag *diag)
{
    dit_comm_request req;
    dit_status st =
        c->ops->sendrecv_start(c, send, send_bytes, dst, recv, recv_bytes, src, &req, diag);
    if (st != DIT_OK)
        return st;
    return c->ops->sendrecv_wait(c, &req, diag);
}

void dit_comm_destroy(dit_comm *c)
{
    if (c)
        c->ops->destroy(c);
}
