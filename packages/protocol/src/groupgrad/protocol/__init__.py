"""groupgrad.protocol: where a grouped layer's weight gradient goes, in which dtype, exactly once.

Two parts:

* The ``DistributedWeight`` protocol and its dispatchers, for weights whose
  storage and gradient reduction belong to someone else (sharded expert
  weights): :class:`DistributedWeight`, :func:`is_distributed_weight`,
  :func:`materialize_weight_for_forward`, :func:`materialize_weight_for_backward`,
  :func:`finalize_weight_grads`, :func:`weight_grad_dtype`,
  :func:`weight_grad_buffers`.
* The ``main_grad`` contract, resolved into a :class:`WeightGradPlan` by
  :func:`plan_weight_grads` (with :func:`defer_weight_grads` and
  :func:`accumulate_grads_like_autograd` for a deferred wgrad GEMM). The
  framework attributes (``main_grad``, ``__fsdp_param__``/``get_main_grad()``,
  ``overwrite_main_grad``, ``grad_added_to_main_grad``, ``zero_out_wgrad``)
  are read in this package and nowhere else; implementers of
  ``DistributedWeight`` read them through :func:`fetch_main_grad`,
  :func:`main_grad_or_none`, :func:`overwrites_main_grad`,
  :func:`takes_grad_added_flag`, :func:`mark_grad_added`, :func:`dummy_wgrad`,
  :func:`rezeroes_dummy` and :func:`is_fsdp_param`, and deliver a finished
  gradient with :func:`deliver_to_main_grad` (copy or add, then mark).
  PyTorch's own ``grad_dtype`` is read through :func:`grad_dtype_of`: the
  dtype a wgrad reaches autograd in, and the dummy's.
"""

__version__ = "0.1.0"

from groupgrad.protocol._attrs import (
    MAIN_GRAD_DTYPES,
    deliver_to_main_grad,
    dummy_wgrad,
    fetch_main_grad,
    grad_dtype_of,
    is_fsdp_param,
    main_grad_or_none,
    mark_grad_added,
    overwrites_main_grad,
    rezeroes_dummy,
    set_overwrite_main_grad,
    takes_grad_added_flag,
)
from groupgrad.protocol._buffers import weight_grad_buffers
from groupgrad.protocol._distributed import (
    DistributedWeight,
    WeightGroup,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
    weight_grad_dtype,
)
from groupgrad.protocol._hooks import (
    accumulate_grads_like_autograd,
    hold_post_accumulate_grad_hooks,
    release_post_accumulate_grad_hooks,
    run_post_accumulate_grad_hooks,
)
from groupgrad.protocol._plan import (
    WeightGradPlan,
    autograd_dummies,
    defer_weight_grads,
    plan_weight_grads,
    receives_dummy,
)
from groupgrad.protocol._route import WgradRoute, autograd_grad_dtype, wgrad_route

__all__ = [
    "MAIN_GRAD_DTYPES",
    "DistributedWeight",
    "WeightGradPlan",
    "WeightGroup",
    "WgradRoute",
    "accumulate_grads_like_autograd",
    "autograd_dummies",
    "autograd_grad_dtype",
    "defer_weight_grads",
    "deliver_to_main_grad",
    "dummy_wgrad",
    "fetch_main_grad",
    "finalize_weight_grads",
    "grad_dtype_of",
    "hold_post_accumulate_grad_hooks",
    "is_distributed_weight",
    "is_fsdp_param",
    "main_grad_or_none",
    "mark_grad_added",
    "materialize_weight_for_backward",
    "materialize_weight_for_forward",
    "overwrites_main_grad",
    "plan_weight_grads",
    "receives_dummy",
    "release_post_accumulate_grad_hooks",
    "rezeroes_dummy",
    "run_post_accumulate_grad_hooks",
    "set_overwrite_main_grad",
    "takes_grad_added_flag",
    "weight_grad_buffers",
    "weight_grad_dtype",
    "wgrad_route",
]
