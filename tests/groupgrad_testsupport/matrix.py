"""The module matrix: one :class:`Case` per combination of the options DESIGN.md names.

``GroupedLinear`` and ``GroupedMLP`` are each tested over
{per-expert, single grouped weight} × {plain, distributed} × {no main_grad,
accumulate, overwrite} × {delay, no delay} × {zero_out_wgrad} × {bias}::

    CASES = [c for c in Case.all() if not (c.zero_out and c.main_grad == "none")]

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
    def test_matches_reference(case: Case) -> None: ...
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, get_args

Layout = Literal["per_expert", "single"]
Kind = Literal["plain", "distributed"]
MainGrad = Literal["none", "accumulate", "overwrite"]


@dataclass(frozen=True)
class Case:
    """One combination of module options.

    Attributes:
        layout: ``"per_expert"``: one parameter per expert (``weight0`` ..);
            ``"single"``: one packed ``(E, N, K)`` parameter
            (``single_grouped_weight=True``).
        kind: ``"plain"``: ordinary parameters; ``"distributed"``: the
            weights are a ``DistributedWeight`` group (the protocol's fakes
            in the single-process tests).
        main_grad: ``"none"``: wgrads go to ``.grad``
            (``accumulate_into_main_grad=False``); ``"accumulate"``: added into
            a ``main_grad`` that holds earlier values; ``"overwrite"``: copied
            into a ``main_grad`` (``overwrite_main_grad=True``) poisoned with NaN.
        delay: ``delay_wgrad_compute=True``: wgrads run at ``backward_dw()``.
        zero_out: ``zero_out_wgrad=True``: the zero dummy autograd receives is
            re-zeroed before each hand-out (meaningful with a ``main_grad``).
        bias: The module has biases.
    """

    layout: Layout
    kind: Kind
    main_grad: MainGrad
    delay: bool
    zero_out: bool
    bias: bool

    @property
    def id(self) -> str:
        """A pytest id such as ``per_expert-plain-accumulate-delay-keep-bias``."""
        return "-".join(
            [
                self.layout,
                self.kind,
                self.main_grad,
                "delay" if self.delay else "now",
                "zero_out" if self.zero_out else "keep",
                "bias" if self.bias else "nobias",
            ]
        )

    @classmethod
    def all(cls) -> list[Case]:
        """Every combination, in the order of the fields (layout varies slowest)."""
        return [
            cls(*combo)
            for combo in itertools.product(
                get_args(Layout),
                get_args(Kind),
                get_args(MainGrad),
                (False, True),
                (False, True),
                (False, True),
            )
        ]
