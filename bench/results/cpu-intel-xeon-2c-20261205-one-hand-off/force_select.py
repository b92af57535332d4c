# throwaway: kvmove's torch-backend gathers forced onto a per-layer index_select (no numpy take,
# no 3-D index_select of a stacked cache): imported first by the measuring scripts when
# KVMOVE_FORCE_SELECT=1
import os, sys
if os.environ.get("KVMOVE_FORCE_SELECT") == "1":
    import kvmove.rows.torch_backend as tb
    tb.STACKED_SELECT_MAX_BYTES = 0
    orig = tb.threads_for
    GATHER_LINE = int(os.environ["GATHER_LINE"])
    def threads_for(layer_bytes, layers):
        if sys._getframe(1).f_lineno == GATHER_LINE:
            return 0
        return orig(layer_bytes, layers)
    tb.threads_for = threads_for
