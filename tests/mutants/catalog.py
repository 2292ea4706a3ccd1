"""The deliberate breaks ``nox -s mutants`` applies, one at a time, to a copy of the tree.

Each :class:`Mutant` replaces one exact snippet of one file (it must occur
exactly once, so a stale entry fails loudly instead of testing nothing) and
names the test paths that must catch it. The list holds the founding bugs of
DESIGN.md, every silent-wrong-gradient behaviour of the reliability review
reintroduced, and the breaks that showed tests unable to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

MODULES = "packages/modules/tests"
PROTOCOL = "packages/protocol/tests"
KERNELS = "kernels/tests"
TORCH_DISTRIBUTED = "integrations/torch_distributed/tests"


@dataclass(frozen=True)
class Mutant:
    """One deliberate break.

    Attributes:
        name: Short identifier, printed with the catching tests.
        what: The behaviour the break reintroduces.
        path: File to change, relative to the repository root.
        old: Exact text to replace (must occur exactly once in ``path``).
        new: Replacement text.
        tests: Test paths (pytest arguments) that must fail with the break.
    """

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


_GROUP = "packages/modules/src/groupgrad/modules/_group.py"
_WGRAD = "packages/modules/src/groupgrad/modules/_wgrad.py"
_PLAN = "packages/protocol/src/groupgrad/protocol/_plan.py"
_ATTRS = "packages/protocol/src/groupgrad/protocol/_attrs.py"
_ROUTE = "packages/protocol/src/groupgrad/protocol/_route.py"
_BUFFERS = "packages/protocol/src/groupgrad/protocol/_buffers.py"
_DISTRIBUTED = "packages/protocol/src/groupgrad/protocol/_distributed.py"
_REFERENCE = "kernels/src/groupgrad/kernels/_reference.py"
_OPS = "kernels/src/groupgrad/kernels/_ops.py"
_RULES = "kernels/src/groupgrad/kernels/_rules.py"
_KERNEL_GROUP = "kernels/src/groupgrad/kernels/_group.py"
_SUPPORT = "kernels/src/groupgrad/kernels/_support.py"
_BUILD = "kernels/src/groupgrad/kernels/build.py"
_TD = "integrations/torch_distributed/src/groupgrad/integrations/torch_distributed"
_COMPILED = "packages/modules/src/groupgrad/modules/_compiled.py"
_COMPILE_TESTS = f"{MODULES}/test_compile.py"

MUTANTS: tuple[Mutant, ...] = (
    # --- the founding bugs (DESIGN.md)
    Mutant(
        "overwrite-ignored",
        "overwrite_main_grad ignored: the wgrad always accumulates (stale gradients kept)",
        _PLAN,
        "accumulate=not overwrite[0],",
        "accumulate=True,",
        (MODULES,),
    ),
    Mutant(
        "distributed-wgrad-in-compute-dtype",
        "a distributed group's wgrad allocated in bf16 although main_grad is fp32",
        _DISTRIBUTED,
        "            return main_grad.dtype",
        "            return compute_dtype",
        (MODULES, PROTOCOL),
    ),
    Mutant(
        "plain-follower-crash",
        "a plain follower in a distributed group asked for grad_buffer() (AttributeError)",
        _BUFFERS,
        "buffers.append(provider() if callable(provider) else None)",
        "buffers.append(member.grad_buffer())",
        (MODULES, PROTOCOL),
    ),
    # --- torch.compile keeps the fp32 route (the traced graph casts a bf16 parameter's wgrad)
    Mutant(
        "compiled-wgrad-in-bf16",
        "under torch.compile the backward traces the eager wgrad step: bf16 parameters' fp32 "
        "wgrads are rounded to bf16 by the graph",
        _COMPILED,
        "    if not torch.compiler.is_compiling():\n        if queue is not None",
        "    if True:\n        if queue is not None",
        (_COMPILE_TESTS,),
    ),
    Mutant(
        "compiled-hooks-twice",
        "under torch.compile a delivered gradient's post-accumulate hooks run twice",
        _COMPILED,
        "[g for _, g in picked], run_hooks=False",
        "[g for _, g in picked], run_hooks=True",
        (_COMPILE_TESTS,),
    ),
    Mutant(
        "compiled-grad-written-when-not-accumulated",
        "under torch.compile .grad is written although the backward does not accumulate there",
        _COMPILED,
        "in zip(live, accumulates, strict=True) if takes}",
        "in zip(live, accumulates, strict=True)}",
        (_COMPILE_TESTS,),
    ),
    Mutant(
        "compiled-deferred-operands-shared",
        "under torch.compile a deferred wgrad keeps the graph's own dy and x buffers",
        _COMPILED,
        "        operands = [t.clone() for t in operands]\n",
        "",
        (_COMPILE_TESTS,),
    ),
    # --- the silent wrong gradients of the reliability review
    Mutant(
        "splits-by-reference",
        "splits kept by reference: a refilled tokens-per-expert buffer changes backward",
        _GROUP,
        "        return splits.clone()\n",
        "        return splits\n",
        (MODULES,),
    ),
    Mutant(
        "splits-list-by-reference",
        "a splits list kept by reference",
        _GROUP,
        "        return tuple(splits)  # once: a generator feeds every GEMM of the op the same counts\n",
        "        return splits\n",
        (MODULES,),
    ),
    Mutant(
        "deferred-inputs-unchecked",
        "backward_dw() reads x and dy without checking they are unchanged since backward",
        _WGRAD,
        "            if now != version:",
        "            if False:",
        (MODULES,),
    ),
    Mutant(
        "frozen-member-written",
        "a frozen member of a main_grad group is written and flagged",
        _PLAN,
        "    trainable = [bool(param.requires_grad) for param in members]",
        "    trainable = [True for param in members]",
        (MODULES,),
    ),
    Mutant(
        "frozen-member-main-grad-as-scratch",
        "a frozen member that has a main_grad gets it as the GEMM's scratch (and its gradient)",
        _PLAN,
        "        buffers = [fetched[i] if keep else next(scratch) for i, keep in enumerate(trainable)]",
        "        buffers = [\n"
        "            fetched[i] if keep else getattr(members[i], 'main_grad', None)\n"
        "            if getattr(members[i], 'main_grad', None) is not None else next(scratch)\n"
        "            for i, keep in enumerate(trainable)\n"
        "        ]",
        (MODULES,),
    ),
    Mutant(
        "frozen-member-flagged",
        "a frozen member is flagged grad_added_to_main_grad and handed a dummy",
        _PLAN,
        "    return bool(param.requires_grad) and takes_grad_added_flag(param)",
        "    return takes_grad_added_flag(param)",
        (MODULES,),
    ),
    Mutant(
        "dummy-not-rezeroed",
        "the shared dummy handed out again after something wrote into it",
        _ATTRS,
        "    elif zero_out or cached.buffer._version != cached.version:",
        "    elif zero_out:",
        (MODULES, PROTOCOL),
    ),
    Mutant(
        "zero-out-wgrad-ignored",
        "zero_out_wgrad ignored: an unversioned write into the dummy survives",
        _ATTRS,
        "    elif zero_out or cached.buffer._version != cached.version:",
        "    elif cached.buffer._version != cached.version:",
        (MODULES, PROTOCOL),
    ),
    Mutant(
        "dummy-in-param-dtype",
        "the dummy in the parameter's dtype instead of its grad_dtype",
        _ATTRS,
        "    key = (tuple(param.shape), grad_dtype_of(param), param.device, zero_out)",
        "    key = (tuple(param.shape), param.dtype, param.device, zero_out)",
        (MODULES,),
    ),
    Mutant(
        "accumulate-reshapes",
        "accumulate_grads_like_autograd reshapes a same-numel gradient of another shape",
        "packages/protocol/src/groupgrad/protocol/_hooks.py",
        "        if grad.shape != param.shape:",
        "        if grad.numel() != param.numel():",
        (MODULES, PROTOCOL),
    ),
    Mutant(
        "grad-dtype-ignored",
        "the autograd route computes the wgrad in the parameter's dtype, ignoring grad_dtype",
        _PLAN,
        "    dtype = autograd_dtype(members) if uniform is None else uniform[0]",
        "    dtype = members[0].dtype",
        (MODULES,),
    ),
    Mutant(
        "uniform-group-unchecked",
        "the one-pass reading of a plain group takes the leader's grad_dtype and trainability "
        "for every member (a frozen or fp32-grad member among bf16 ones goes unseen)",
        _ROUTE,
        "    if trainable and isinstance(dtype, torch.dtype) and facts.count(first) == len(facts):",
        "    if trainable and isinstance(dtype, torch.dtype):",
        (PROTOCOL, MODULES),
    ),
    Mutant(
        "bias-grad-dtype-ignored",
        "a uniform plain group's autograd dtype (the bias gradients') is the compute dtype, "
        "not the members' grad_dtype",
        _ROUTE,
        "    return autograd_dtype(as_weight_list(weights)) if uniform is None else uniform[0]",
        "    return autograd_dtype(as_weight_list(weights)) if uniform is None else torch.bfloat16",
        (MODULES,),
    ),
    Mutant(
        "autocast-ignored",
        "torch.autocast ignored: GEMMs run in the parameters' dtype",
        _GROUP,
        '    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):\n'
        "        return torch.get_autocast_dtype(device_type)",
        "    if False:\n        return torch.get_autocast_dtype(device_type)",
        (MODULES,),
    ),
    Mutant(
        "mlp-half-written",
        "a fused MLP writes fc2's main_grad before fc1's main_grad is found malformed",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    if deferred is None:  # every main_grad GEMM is checked before any GEMM writes\n",
        "    if False:\n",
        (f"{MODULES}/test_bad_inputs.py",),
    ),
    Mutant(
        "kernel-writes-a-leaf",
        "grouped_wgrad writes into an output that requires grad",
        _RULES,
        "    if t.requires_grad and torch.is_grad_enabled():",
        "    if False:",
        (MODULES, KERNELS),
    ),
    # --- breaks that tests used to let through
    Mutant(
        "finalize-gets-members-reversed",
        "the dispatcher hands finalize_group_grads the members' wgrads in reverse order",
        _DISTRIBUTED,
        '    result = _leader_method(leader, "finalize_group_grads")(argument)',
        "    argument = argument[::-1] if isinstance(argument, list) else argument\n"
        '    result = _leader_method(leader, "finalize_group_grads")(argument)',
        (MODULES,),
    ),
    Mutant(
        "op-path-wgrad-zeros",
        "the custom op's wgrad (the path torch.compile takes) writes zeros",
        _OPS,
        '    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""\n'
        "    _reference.wgrad(dy, x, splits, out, accumulate)",
        '    """Reference kernel: ``dw_e = dy_e.T @ x_e``, added to or written into ``out``."""\n'
        "    for dw in out:\n"
        "        dw.zero_()",
        (f"{MODULES}/test_linear.py", f"{KERNELS}/test_custom_ops.py"),
    ),
    Mutant(
        "reference-dgrad-rotated",
        "the reference dgrad (shared by a kernel and its twin) uses the next expert's weight",
        _REFERENCE,
        "    w_list, splits = _per_expert_and_counts(w_group, splits_E, a_TX, a_name)\n",
        "    w_list, splits = _per_expert_and_counts(w_group, splits_E, a_TX, a_name)\n"
        "    if not transpose_weights:  # dgrad only\n"
        "        w_list = [*w_list[1:], *w_list[:1]]\n",
        (KERNELS,),
    ),
    Mutant(
        "wgrad-three-times",
        "every wgrad three times too large (what the demo test must see)",
        _REFERENCE,
        "        dyT_NT, x_TK_e = dy_TN[rows].float().T, x_TK[rows].float()",
        "        dyT_NT, x_TK_e = 3 * dy_TN[rows].float().T, x_TK[rows].float()",
        ("tests/test_demo.py",),
    ),
    Mutant(
        "backward-dw-runs-without-delay",
        "backward_dw() acts on a module without delay_wgrad_compute",
        "packages/modules/src/groupgrad/modules/_base.py",
        "        if len(self._wgrad_queue) or (self.delay_wgrad_compute and not self._in_fused_op):",
        "        if True:",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "masters-clip-norm-of-local-shards",
        "MasterWeights.clip_grad_norm_ sums this rank's shards only: each rank clips by another, "
        "smaller norm",
        "integrations/torch_distributed/src/groupgrad/integrations/torch_distributed/_master.py",
        "            dist.all_reduce(total, group=group)\n",
        "",
        (
            f"{TORCH_DISTRIBUTED}/test_training_loop.py::test_clipping_the_masters_measures_every_ranks_shards",
        ),
    ),
    # --- torch_distributed: a training loop around sharded experts corrupts and loses nothing
    Mutant(
        "ddp-broadcasts-shards",
        "shard_expert_weights leaves DDP's ignore list alone: DDP copies rank 0's shards everywhere",
        f"{_TD}/_shard.py",
        "    register_ddp_ignore(module, [name for group in groups for name in group.names])",
        "    pass",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "ddp-reduces-root-shards",
        "root-level sharded weights listed under one name only: DDP's reducer all-reduces them",
        f"{_TD}/_ddp.py",
        'for spelling in (name,) if "." in name else (name, f".{name}"):',
        "for spelling in (name,):",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "sharding-unties-tied-weights",
        "shard_expert_weights gives each of two layers sharing their weights its own shard: each "
        "gets only its own use's gradient, and the copies drift apart",
        f"{_TD}/_shard.py",
        "    _refuse_shared(module, planned)\n",
        "",
        (f"{TORCH_DISTRIBUTED}/test_bad_inputs.py",),
    ),
    Mutant(
        "sharding-takes-parametrized-weights",
        "shard_expert_weights reaches a parametrized weight after replacing earlier layers' and "
        "stops with a bare KeyError",
        f"{_TD}/_shard.py",
        "        if parametrize.is_parametrized(layer, attr):",
        "        if False:",
        (f"{TORCH_DISTRIBUTED}/test_bad_inputs.py",),
    ),
    Mutant(
        "full-load-below-a-parent-half-written",
        "load_full_state_dict of another rank's file into a parent of the sharded module loads the "
        "modules before it, then refuses",
        f"{_TD}/_checkpoint.py",
        "                _check_entry(found.group, name, state[name])\n",
        "                pass\n",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "ddp-overwrite-unnoticed",
        "DDP around a parent overwrites the shards with rank 0's and the first forward says nothing",
        f"{_TD}/_shard_group.py",
        "            if differed is not None:  #",
        "            if False:  #",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "sharded-frozen-member-written",
        "the reduce-scatter writes a frozen member's main_grad and sets its flag",
        f"{_TD}/_shard_group.py",
        "                deliver_to_main_grad(member, shard_grad, name)",
        "                if member.main_grad is not None:\n"
        "                    member.main_grad.add_(shard_grad)\n"
        "                member.grad_added_to_main_grad = True",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "state-dict-plain-shards",
        "state_dict() gives each rank's rows under the full name, without sharding metadata",
        f"{_TD}/_checkpoint.py",
        "            if key in state_dict and not isinstance(state_dict[key], DTensor):",
        "            if False:",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "another-ranks-rows-loaded",
        "a per-rank file loaded on another rank gives that rank the saver's rows",
        f"{_TD}/_checkpoint.py",
        "    if coordinate is None or list(coordinate) != [group.rank]:",
        "    if False:",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "full-load-writes-before-checking",
        "load_full_state_dict loads some weights, then rejects a wrong shape",
        f"{_TD}/_checkpoint.py",
        "        if key in expected and tuple(value.shape) != expected[key]:",
        "        if False:",
        (f"{TORCH_DISTRIBUTED}/test_bad_inputs.py",),
    ),
    Mutant(
        "master-weights-not-copied-back",
        "MasterWeights steps the fp32 masters but never copies them into the bf16 shards",
        f"{_TD}/_master.py",
        "            param.copy_(master)",
        "            pass",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    # --- the lean checks of listed groups (host cost) must reject what the full ones do
    Mutant(
        "lean-overlap-ignores-inputs",
        "the lean overlap sweep of alike members never compares them with the inputs",
        _KERNEL_GROUP,
        "        if starts and (is_output or group_is_output):",
        "        if False:",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "lean-overlap-ignores-members",
        "the lean overlap sweep of alike outputs never compares them with each other",
        _KERNEL_GROUP,
        "        group_is_output\n        and len(starts) > 1",
        "        False\n        and len(starts) > 1",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "lean-support-skips-alignment",
        "the support check of alike members trusts their addresses",
        _SUPPORT,
        "        and first.numel()\n        and not any(map(ALIGNMENT_BYTES.__rmod__, listed.starts))\n",
        "        and first.numel()\n",
        (f"{KERNELS}/test_support.py",),
    ),
    Mutant(
        "lean-test-ignores-shape",
        "the lean test of a listed group does not compare shapes",
        _KERNEL_GROUP,
        "        and set(map(_SHAPE, tensors)) == {first.shape}\n",
        "",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "variant-epilogue-dropped",
        "a variant's epilogue subtile never reaches the generated source (its name lies)",
        _BUILD,
        "                str(self.epilogue_n),\n",
        "",
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "fp8-malformed-splits-scales-kept",
        "malformed device splits leave the (128, 1) form's scales finite: it dequantizes to "
        "plausible wrong values",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        '.masked_fill_(where.malformed, float("nan"))\n',
        "\n",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-listed-weights-unchecked",
        "a list of weights goes to the quantizer unchecked: a member of another shape, dtype "
        "or type fails inside the kernel instead of being named",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "    elif (facts := listed_facts(members, first)).alike:",
        "    elif facts := listed_facts(members, first):",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-dgrad-ref-reads-data",
        "the reference FP8 dgrad reads the weights' data where the CUDA kernel reads data_t: a "
        "form whose orientations disagree gives CPU and GPU different answers",
        "kernels/src/groupgrad/kernels/_fp8_gemm.py",
        '    if op == "fprop":\n        w32 = _weights(w_data, w_scales)\n',
        "    if True:\n        w32 = _weights(w_data, w_scales)\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-row-offsets-edit-unseen",
        "an Fp8Blocks whose row_offsets were written in place after quantization passes the "
        "checks when the new counts keep its 16-aligned layout: the wgrad reads shifted tokens",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "        if seal[0][:-1] == state[:-1] and seal[0][-1] != state[-1]:\n",
        "        if False:\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-malformed-splits-dequantized",
        "dequantize of a (128, 1) form with malformed offsets returns finite values",
        "kernels/src/groupgrad/kernels/_fp8.py",
        '        return out.masked_fill_(where.malformed, float("nan"))',
        "        return out",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-operand-strides-unchecked",
        "a hand-built Fp8Blocks whose scales or data have the right shape but another layout "
        "reaches the kernels, which read it as the layout they expect",
        "kernels/src/groupgrad/kernels/_validate.py",
        "            and (strides is None or t.stride() == strides or _same_memory(t, strides))\n",
        "",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-operand-dtypes-unchecked",
        "a hand-built (128, 1) Fp8Blocks with int32 running counts reaches the FP8 wgrad, "
        "whose setup kernel reads them as int64",
        "kernels/src/groupgrad/kernels/_validate.py",
        "            and t.dtype == dtype\n",
        "",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-cutlass-mainloop-uncleared",
        "CUTLASS's FP8 blockwise mainloop adds its first promoted block to the accumulator "
        "registers as allocated (a persistent kernel's previous tile), right only while the "
        "compiler folds the undefined addend",
        "kernels/src/groupgrad/kernels/csrc/fp8_overlap_mainloop.cuh",
        "    cute::clear(accum);\n",
        "",
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "fp8-overlap-uncleared",
        "the overlapped FP8 mainloop adds its first promoted block to the accumulator registers "
        "as allocated",
        "kernels/src/groupgrad/kernels/csrc/fp8_overlap_mainloop.cuh",
        "    clear(accum);\n    if (k_tile_count <= 0) {\n",
        "    if (k_tile_count <= 0) {\n",
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "fp8-cutlass-mainloop-unwrapped",
        "the FP8 kernels without the overlap take CUTLASS's mainloop as built, whose main "
        "accumulator is never cleared",
        "kernels/src/groupgrad/kernels/csrc/fp8_gemm.cuh",
        "ClearedAccumulatorMainloop<BuiltMainloop>>;",
        "BuiltMainloop>;",
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "fp8-overlap-dropped",
        "an FP8 variant's mainloop choice never reaches the generated source (every kernel "
        "would take the next template argument's place: a wrong tile, or no overlap)",
        _BUILD,
        "                _cpp_bool(self.overlap),\n",
        "",
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "plan-swizzle-unchecked",
        "a plan takes any swizzle (the extension's own check crashes the process)",
        _SUPPORT,
        "        if type(swizzle) is not int or swizzle not in (1, 2, 4, 8):",
        "        if False:",
        (f"{KERNELS}/test_build.py",),
    ),
    # --- each rule's cheap test for the common call accepts nothing its naming checks reject
    Mutant(
        "cheap-call-ignores-overlap",
        "the cheap test of fprop/dgrad's out lets it share memory with packed weights",
        _RULES,
        "        and not _group.contiguous_meets(out_TX, (a, w_group[0], *[t for _, t in also]))\n",
        "",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "cheap-overlap-measures-padded-inputs-by-their-bytes",
        "the cheap overlap test takes a row-padded input to end after its bytes, not its last "
        "row: an out lying in its later rows is accepted and the GEMM overwrites what it reads",
        "kernels/src/groupgrad/kernels/_group.py",
        "        if t.is_contiguous():\n            p = t.data_ptr()",
        "        if True:\n            p = t.data_ptr()",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "reference-refuses-inference-outputs-midway",
        "the reference writes an output made under torch.inference_mode() in place outside it: "
        "PyTorch raises after some experts were written, where CUTLASS writes them all",
        "kernels/src/groupgrad/kernels/_reference.py",
        "    if any(map(Tensor.is_inference, [out] if isinstance(out, Tensor) else out)):",
        "    if False:",
        (f"{KERNELS}/test_dispatch.py",),
    ),
    Mutant(
        "fp8-cache-lets-the-quantized-memory-go",
        "the FP8 weight cache does not hold the memory its weights had: two `.data =` "
        "assignments can put a weight back at the recorded address, and False serves stale FP8",
        "packages/modules/src/groupgrad/modules/_fp8_cache.py",
        "        storages = tuple(p.untyped_storage() for p in params)",
        "        storages = ()",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "groups-take-unordered-collections",
        "weights, out or splits given as a set (no expert order), a dict or a generator (read "
        "once, returned spent) are taken: experts get each other's weights",
        _RULES,
        "    unordered = str | bytes | Set | Mapping | Iterator",
        "    unordered = str | bytes",
        (f"{KERNELS}/test_validation.py", f"{KERNELS}/test_fp8_quant.py"),
    ),
    Mutant(
        "empty-device-splits-unchecked",
        "a device splits tensor of no entries passes for a tensor of rows: its length, readable "
        "without a sync, is not compared",
        _RULES,
        "        elif splits.shape[0] == 0:  # no counts to read: none sum to rows but 0 rows",
        "        elif False:",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-layout-dtype-misfit-is-a-valueerror",
        "an Fp8Blocks tensor of another dtype (int32 row_offsets, e5m2 data_t) raises ValueError, "
        "not the TypeError every wrong dtype raises",
        "kernels/src/groupgrad/kernels/_validate.py",
        "            raise (TypeError if wrong_dtype else ValueError)(",
        "            raise ValueError(",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "delayed-weight-hooks-ignored",
        "a Tensor.register_hook hook on a weight whose gradient backward_dw() puts into .grad "
        "is called with None by autograd, and the gradient lands unhooked",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    elif queue is not None:\n        how = ",
        "    elif False:\n        how = ",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "compiled-parameter-hooks-ignored",
        "compiled, a Tensor.register_hook hook on a weight or bias is called with None and the "
        "gradient the op puts into .grad lands unhooked",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    if compiled:\n        _refuse_hooked(",
        "    if False:\n        _refuse_hooked(",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "autograd-grad-of-delayed-weights-answered-none",
        "torch.autograd.grad over a delayed layer's weights (no main_grad) gets None while a "
        "backward_dw() job is queued that later writes .grad",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    if queued and None in states and target.route() is WgradRoute.AUTOGRAD:",
        "    if False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "distributed-scratch-rounds-fp32-followers",
        "a distributed group whose leader has no main_grad types its plain followers' scratch "
        "bf16 while their main_grads are fp32: the reduce receives rounded wgrads",
        "packages/protocol/src/groupgrad/protocol/_plan.py",
        "            _check_scratch_dtype(members, compute_dtype, labels)\n",
        "",
        (f"{PROTOCOL}/test_plan.py",),
    ),
    Mutant(
        "fsdp2-blind-to-groupgrad-experts-in-plain-sub-units",
        "a plain-FSDP2 sub-unit holding Hugging Face experts that run on groupgrad passes: their "
        "wgrads reach the reduce-scatter rounded to bf16",
        "integrations/fsdp2/src/groupgrad/integrations/fsdp2/_validate.py",
        '    return experts and isinstance(chosen, str) and chosen.startswith("groupgrad")',
        "    return False",
        ("tests/test_hf_fsdp2.py",),
    ),
    Mutant(
        "two-uses-queue-two-jobs",
        "a layer used twice in one forward with delay_wgrad_compute queues a job per use: "
        "backward_dw() once per backward leaves half the gradient for the next step",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "        if self._jobs and same_backward(task, self._last_task):",
        "        if False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "two-uses-hooks-run-on-each-half",
        "a delayed layer used twice runs its post-accumulate-grad hooks after each use's GEMM, "
        "the first time on half of the gradient",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "        last.append(all(backward_of(other) != mine for other in tasks))",
        "        last.append(True)",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "two-uses-overwrite-each-other",
        "a layer used twice in one backward with overwrite_main_grad: the second use's GEMM "
        "overwrites the first's in main_grad",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "    return id(param) in pending or (task is not None and backward_of(task) == backward)\n",
        "    return id(param) in pending\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "loaded-overwrite-record-taken-for-own",
        "a parameter record pickled with torch.save(module) counts in the loading process: a "
        "backward there with the saved graph task's number adds into main_grad where it must "
        "overwrite",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "    return value[1] if isinstance(value, tuple) and value[0] is _PROCESS else None\n",
        "    return value[1] if isinstance(value, tuple) else None\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "held-hooks-record-loaded",
        "the record of hooks a deferred wgrad holds back is pickled with torch.save(module) "
        "(empty): the loaded copy takes its own hooks for held, and autograd runs them at "
        "backward, before backward_dw() delivers the gradient",
        "packages/protocol/src/groupgrad/protocol/_hooks.py",
        "        return (type(None), ())\n",
        "        return (_Held, ({},))\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "thawed-weight-written",
        "a weight frozen when the forward ran and thawed before backward gets its wgrad in "
        "main_grad (or a deferred .grad): requires_grad read at backward only",
        "packages/modules/src/groupgrad/modules/_wgrad.py",
        "        if thawed and (deferred or self.route() is not WgradRoute.AUTOGRAD):\n",
        "        if False:\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "mlp-layer-settings-unchecked",
        "fc1 / fc2 of a GroupedMLP given delay_wgrad_compute or fp8_recipe of their own: the "
        "fused op ignores it silently",
        "packages/modules/src/groupgrad/modules/_mlp.py",
        "        self._check_layers()\n",
        "",
        (f"{MODULES}/test_mlp.py",),
    ),
    Mutant(
        "mlp-layers-backward-dw-refuses",
        "backward_dw() of a GroupedMLP's fc1 / fc2 with nothing of its own queued raises 'no "
        "backward has queued': a loop over a model's modules stops there",
        "packages/modules/src/groupgrad/modules/_base.py",
        "(self.delay_wgrad_compute and not self._in_fused_op)",
        "self.delay_wgrad_compute",
        (f"{MODULES}/test_mlp.py",),
    ),
    Mutant(
        "mlp-settings-not-propagated",
        "a GroupedMLP's delay_wgrad_compute set after construction does not reach fc1 and fc2",
        "packages/modules/src/groupgrad/modules/_mlp.py",
        "            setattr(self.fc1, name, value)\n            setattr(self.fc2, name, value)\n",
        "            pass\n",
        (f"{MODULES}/test_mlp.py",),
    ),
    Mutant(
        "two-delayed-uses-overwrite-each-other",
        "a delayed layer used twice with overwrite_main_grad: backward_dw()'s second GEMM "
        "overwrites the first's in main_grad",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "                pending.update(map(id, entry.target.params))",
        "                pending.update(())",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "deferred-job-blind-to-a-frozen-weight",
        "a weight frozen between backward and backward_dw() gets nothing (its flag set, its "
        "hooks held), without a word",
        "packages/modules/src/groupgrad/modules/_wgrad.py",
        "        if trainable != self.trainable:",
        "        if False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "queued-job-stranded-when-delay-switched-off",
        "backward_dw() is a no-op once delay_wgrad_compute is switched off, with a job queued: "
        "its gradient never lands and its hooks stay held",
        "packages/modules/src/groupgrad/modules/_base.py",
        "        if len(self._wgrad_queue) or (self.delay_wgrad_compute and not self._in_fused_op):",
        "        if self.delay_wgrad_compute and not self._in_fused_op:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "routed-mlp-advises-distributed-pairs",
        "routed_grouped_mlp given one distributed group advises making both distributed, which "
        "it then refuses",
        "packages/modules/src/groupgrad/modules/_mlp_args.py",
        "    if plain_only:\n",
        "    if False:\n",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "swiglu-twin-keeps-da-unrounded",
        "swiglu_probs_backward_ref takes an fp32 da as is where the op rounds it to h's dtype: "
        "the twins' dh and dprobs differ",
        "kernels/src/groupgrad/kernels/_swiglu.py",
        "    da_TF = da_TF.to(h_T2F.dtype).to(g_TF.dtype)",
        "    da_TF = da_TF.to(g_TF.dtype)",
        (f"{KERNELS}/test_swiglu.py",),
    ),
    Mutant(
        "test-support-needs-pytest",
        "the test support imports pytest at its top: the Megatron-Core example, which loads it "
        "from a checkout, fails without pytest",
        "tests/groupgrad_testsupport/calls.py",
        "if TYPE_CHECKING:  # pytest only where the tests run: the support imports without it\n"
        "    import pytest",
        "import pytest",
        ("tests/test_testsupport.py",),
    ),
    Mutant(
        "fused-experts-skip-megatrons-param-gather-hooks",
        "the fused experts never run fc1's and fc2's forward pre-hooks, where Megatron's DDP "
        "waits for (and starts) overlapped parameter all-gathers: stale expert weights",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_experts.py",
        "            _forward_pre_hooks(owner, (x_TH,))",
        "            pass",
        ("integrations/megatron_core/tests/test_megatron_moe.py",),
    ),
    Mutant(
        "megatron-fsdp-zero3-without-units-accepted",
        "shard_model under ZeRO-3 with no FSDP unit in the model goes on to Megatron-FSDP's "
        "bare ZeroDivisionError",
        "integrations/megatron_fsdp/src/groupgrad/integrations/megatron_fsdp/_validate.py",
        "    if None not in classes and not any(  # an unresolved path: Megatron-FSDP's own error",
        "    if False and not any(",
        ("integrations/megatron_fsdp/tests/test_validation.py",),
    ),
    Mutant(
        "megatron-fsdp-unit-paths-unresolved",
        "shard_model takes a dotted fsdp_unit_modules path on trust under ZeRO-3: one naming no "
        "module of the model goes on to Megatron-FSDP's bare ZeroDivisionError",
        "integrations/megatron_fsdp/src/groupgrad/integrations/megatron_fsdp/_validate.py",
        '    path, _, name = str(entry).rpartition(".")',
        '    return None\n    path, _, name = str(entry).rpartition(".")',
        ("integrations/megatron_fsdp/tests/test_validation.py",),
    ),
    Mutant(
        "fused-experts-check-ddp-hooks-after-the-gemms",
        "the fused experts' backward_dw() refuses a DDP without delayed-wgrad hooks only after "
        "its GEMMs wrote the gradients (and used up the job)",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_experts.py",
        "        self._wgrad_hooks.check(type(self).__name__, self._weights())  # before a GEMM writes\n"
        "        self.grouped_mlp.backward_dw()\n",
        "        self.grouped_mlp.backward_dw()\n"
        "        self._wgrad_hooks.check(type(self).__name__, self._weights())\n",
        ("integrations/megatron_core/tests/test_megatron_moe.py",),
    ),
    Mutant(
        "grouped-linears-check-ddp-hooks-after-the-gemms",
        "the grouped-linear experts' backward_dw() refuses a DDP without delayed-wgrad hooks "
        "only after its GEMMs wrote the gradients",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_linear.py",
        "        self._wgrad_hooks.check(type(self).__name__, weights)  # before a GEMM writes\n"
        "        super().backward_dw()\n",
        "        super().backward_dw()\n"
        "        self._wgrad_hooks.check(type(self).__name__, weights)\n",
        ("integrations/megatron_core/tests/test_megatron_moe.py",),
    ),
    Mutant(
        "ddp-hooks-twice-a-bare-stopiteration",
        "backward_dw() of a layer wrapped in Megatron's DDP twice looks for a frozen weight "
        "where none is frozen: a bare StopIteration instead of an error naming the double wrap",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_hooks.py",
        "        frozen = [i for i, w in enumerate(weights) if not w.requires_grad]\n",
        "        frozen = [next(i for i, w in enumerate(weights) if not w.requires_grad)]\n",
        (
            "integrations/megatron_core/tests/test_specs_and_config.py",
            "integrations/megatron_core/tests/test_megatron_moe.py::test_refused_setups_name_the_problem",
        ),
    ),
    Mutant(
        "expert-offloading-unchecked",
        "fine-grained activation offloading of expert activations the experts keep is accepted: "
        "the fused experts silently offload nothing, the grouped linears stop in Megatron's "
        "set_save_original_input with a message about Transformer Engine",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_config.py",
        '    if not getattr(config, "fine_grained_activation_offloading", False):\n',
        "    if True:\n",
        ("integrations/megatron_core/tests/test_specs_and_config.py",),
    ),
    Mutant(
        "fp8-recompute-without-te-accepted",
        "FP8 fused experts accept Megatron's recompute without Transformer Engine: the first "
        "forward stops inside Megatron (NameError: te_checkpoint)",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_fp8.py",
        "    _refuse_recompute_without_te(config, owner)\n",
        "",
        ("integrations/megatron_core/tests/test_megatron_fp8.py",),
    ),
    Mutant(
        "fp8-recompute-refused-with-te-installed",
        "FP8 fused experts refuse Megatron's recompute although Transformer Engine is installed",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_fp8.py",
        "    if _te_installed():\n        return\n",
        "",
        ("integrations/megatron_core/tests/test_megatron_fp8.py",),
    ),
    Mutant(
        "fused-experts-name-groupedmlps-size",
        "a Megatron FP8 size misfit is named in GroupedMLP's words (ffn_hidden_size for "
        "moe_ffn_hidden_size), not the config's",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_fp8.py",
        '    for setting in ("hidden_size", "moe_ffn_hidden_size"):  # named as Megatron names them',
        "    for setting in ():",
        ("integrations/megatron_core/tests/test_megatron_fp8.py",),
    ),
    Mutant(
        "distributed-members-edited-between-forward-and-backward-pass",
        "a DistributedWeight group's shards edited in place after the forward are gathered again "
        "by the backward without a word: the dgrad of values the forward never saw",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "    if not spec.checks_versions or is_fsdp_param(weights[0]):",
        "    if not spec.checks_versions or is_fsdp_param(weights[0]) or is_distributed_weight(weights[0]):",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "routed-int32-slots-reach-the-index-ops",
        "int32 slots, which routed_grouped_mlp takes, reach index ops that want int64: an "
        "IndexError in eager code",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "    slots = slots.to(torch.int64)  # int32 taken too: the index ops want int64\n",
        "",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "routed-slots-unchecked-when-compiled",
        "compiled, routed_grouped_mlp checks no slots: a repeated one leaves a token's output "
        "uninitialised memory",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "    if S == 0:\n        return\n    compiled",
        "    if S == 0 or torch.compiler.is_compiling():\n        return\n    compiled",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "cheap-wgrad-out-ignores-shape",
        "the cheap test of a packed wgrad out takes another (E, N, K)",
        _RULES,
        "        and out.shape == shape\n",
        "",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "cheap-splits-ignores-values",
        "the cheap test of a CPU splits tensor takes counts that do not sum to the rows",
        _RULES,
        "            if _group.counts_fit(splits_E.tolist(), rows):",
        "            if True:",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "prepared-wgrad-runs-twice",
        "a prepared wgrad runs again on a second run(), adding the gradient twice",
        "kernels/src/groupgrad/kernels/_api.py",
        "        if call is None:\n",
        "        if False:\n",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "wgrad-out-loses-parameter-names",
        "a layer's wgrad GEMM names its main_grads out[e] instead of weight3.main_grad",
        _WGRAD,
        "out, names = plan.gemm_out, plan.gemm_names",
        "out, names = plan.gemm_out, None",
        (f"{MODULES}/test_bad_inputs.py",),
    ),
    Mutant(
        "fp8-block-straddles-experts",
        "the (128, 1) quantizer counts 128-token blocks over all tokens, across expert boundaries",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "    column, block_row = seg_offsets[expert] + local, block_offsets[expert] + local // 128\n",
        "    column, block_row = seg_offsets[expert] + local, token // 128\n",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "build-leaves-out-the-quantizer",
        "the extension is built without csrc/fp8_quantize.cu (its binding then fails to load)",
        "kernels/src/groupgrad/kernels/build.py",
        '"fp8_setup.cu", "fp8_quantize.cu", "swiglu_fp8_backward.cu")',
        '"fp8_setup.cu", "swiglu_fp8_backward.cu")',
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "build-leaves-out-the-swiglu-backward",
        "the extension is built without csrc/swiglu_fp8_backward.cu (its binding then fails "
        "to load)",
        "kernels/src/groupgrad/kernels/build.py",
        '"fp8_quantize.cu", "swiglu_fp8_backward.cu")',
        '"fp8_quantize.cu")',
        (f"{KERNELS}/test_build.py",),
    ),
    Mutant(
        "fp8-swiglu-one-kernel-misaligned-h",
        "the FP8 SwiGLU backward's CUDA kernel is handed h's data off 16-byte alignment (its "
        "8-byte cp.async loads of h need it)",
        "kernels/src/groupgrad/kernels/_swiglu_fp8.py",
        "cuda_quantizer(da, padded_tokens) if h_data.data_ptr() % 16 == 0 else None",
        "cuda_quantizer(da, padded_tokens)",
        (f"{KERNELS}/test_swiglu_fp8.py",),
    ),
    Mutant(
        "fp8-cuda-quantizer-takes-fp32",
        "the one-read CUDA quantizer is handed fp32 activations, which it reads as 16-bit values",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():",
        "    if not x.is_contiguous():",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-cuda-quantizer-unaligned",
        "the one-read CUDA quantizer is handed a view 2 bytes off 16-byte alignment (its "
        "16-byte loads fault) or padded tokens not a multiple of 16",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "    if x.data_ptr() % 16 or padded_tokens % 16:\n        return None\n",
        "",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-ops-direct-even-when-traced",
        "the FP8 quantizers and SwiGLU call their kernels directly for fake tensors and under "
        "tracing too (compiled code would lose the ops)",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "    if not _ops.direct_call_ok(present):\n        return op(*args)",
        "    if not present:\n        return op(*args)",
        (f"{KERNELS}/test_fp8_quant.py", f"{KERNELS}/test_swiglu_fp8.py"),
    ),
    Mutant(
        "fp8-ops-never-direct",
        "the FP8 quantizers and SwiGLU always go through torch.library's dispatch (its host cost "
        "on every eager call)",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "    kernel = kernels[0] if present[0].is_cuda else kernels[1]\n    return _ops.run_directly(name, kernel, *args)",
        "    return op(*args)",
        (f"{KERNELS}/test_fp8_quant.py", f"{KERNELS}/test_swiglu_fp8.py"),
    ),
    Mutant(
        "fp8-scale-of-another-block",
        "the (128, 128) quantizer divides each weight tile by its neighbour's scale",
        "kernels/src/groupgrad/kernels/_fp8_ops.py",
        "inverse[spread], finite[spread]).reshape(E, N, K)",
        "inverse.flip(-1)[spread], finite[spread]).reshape(E, N, K)",
        (f"{KERNELS}/test_fp8_quant.py",),
    ),
    Mutant(
        "fp8-wgrad-ignores-accumulate",
        "the FP8 wgrad overwrites main_grad when asked to accumulate into it",
        "kernels/src/groupgrad/kernels/_fp8_gemm.py",
        "    _reference.wgrad(dy32, x32, splits, out, accumulate)",
        "    _reference.wgrad(dy32, x32, splits, out, False)",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-gemm-weights-with-expert-0-scales",
        "the FP8 fprop/dgrad applies expert 0's weight scales to every expert's tiles",
        "kernels/src/groupgrad/kernels/_fp8_gemm.py",
        "        w32 = _weights(w_data, w_scales)\n",
        "        w32 = _weights(w_data, w_scales[:1].expand_as(w_scales))\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-wgrad-splits-unchecked",
        "an FP8 wgrad takes splits other than the ones its operands' blocks were cut by",
        "kernels/src/groupgrad/kernels/_validate.py",
        "    if own_counts != splits_E.tolist():",
        "    if False:",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "ep-gradient-rounded-to-bf16",
        "under transformers' expert parallelism the fp32 gradient of bf16 experts is rounded "
        "through the local shard",
        "integrations/transformers/src/groupgrad/integrations/transformers/_ep.py",
        "    if param is None or wanted is None or wanted == param.dtype:",
        "    if True:",
        ("integrations/transformers/tests/test_expert_parallel.py",),
    ),
    Mutant(
        "compiled-derived-weight-loses-its-gradient",
        "under torch.compile a weight computed from a parameter enters the opaque gradient op, "
        "whose .grad never reaches the parameter",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "        if param.requires_grad and not param.is_leaf:\n            raise RuntimeError(\n"
        '                f"tensor {index}',
        '        if False:\n            raise RuntimeError(\n                f"tensor {index}',
        (f"{MODULES}/test_compile.py",),
    ),
    # --- fp8_recipe="blockwise" in GroupedLinear
    Mutant(
        "fp8-cache-blind-to-in-place-updates",
        "the FP8 weight cache ignores the version counter: after an optimizer step "
        "is_first_microbatch=False reuses weights quantized before it",
        "packages/modules/src/groupgrad/modules/_fp8_cache.py",
        "    return [(p.data_ptr(), p._version, p.shape, p.stride()) for p in params]",
        "    return [(p.data_ptr(), 0, p.shape, p.stride()) for p in params]",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "fp8-wgrad-x-quantized-from-fp8",
        "x's (128, 1) wgrad form is quantized from its dequantized (1, 128) form, not from x",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        '        both = _quantized(x_TK, "x", block=(ROWS, TOKENS), splits=splits)',
        '        rows = _quantized(x_TK, "x", block=ROWS)\n'
        '        tokens = _quantized(rows.dequantize().to(x_TK.dtype), "x", block=TOKENS, '
        "splits=splits)\n"
        "        both = (rows, tokens)",
        (f"{MODULES}/test_linear_matrix.py",),
    ),
    Mutant(
        "fp8-saves-bf16-x-too",
        "the FP8 forward saves the bf16 x beside its FP8 form (gradients right, memory not saved)",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "        ctx.save_for_backward(*saved)",
        "        ctx.save_for_backward(*saved, x_TK)",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    # --- fp8_recipe="blockwise" in GroupedMLP
    Mutant(
        "fp8-mlp-fc2-wgrad-a-quantized-from-fp8",
        "fc2's wgrad operand a is quantized from a's dequantized (1, 128) form, not from the "
        "recomputed bf16 a",
        "kernels/src/groupgrad/kernels/_swiglu_fp8.py",
        "    a = segments_ref(a_TF, *offsets)[:2] if a_tokens else _nothing(da)",
        "    a_TF = _dequantize_rows(*rows_ref(a_TF), a_TF.dtype)\n"
        "    a = segments_ref(a_TF, *offsets)[:2] if a_tokens else _nothing(da)",
        (f"{KERNELS}/test_swiglu_fp8.py", f"{MODULES}/test_mlp_matrix.py"),
    ),
    Mutant(
        "fp8-mlp-forward-swiglu-reads-bf16-h",
        "the forward's SwiGLU reads the bf16 h while backward's reads the kept FP8 h: the "
        "recomputed a (fc2's wgrad operand, dprobs, dh) is not the forward's",
        "kernels/src/groupgrad/kernels/_swiglu_fp8.py",
        "    a_TF = swiglu_math(_dequantize_rows(h_data, h_scales, h.dtype), probs)",
        "    a_TF = swiglu_math(h, probs)",
        (f"{KERNELS}/test_swiglu_fp8.py", f"{MODULES}/test_mlp_matrix.py"),
    ),
    Mutant(
        "swiglu-fp8-kept-h-layout-unchecked",
        "the FP8 SwiGLU backward takes a hand-built (1, 128) h without checking its layout "
        "(row-major scales read as column-major ones)",
        "kernels/src/groupgrad/kernels/_swiglu_fp8.py",
        '    h = fp8_operand("h", h, ROWS)  # a hand-built form with another layout is refused by name',
        "    assert isinstance(h, Fp8Blocks)",
        (f"{KERNELS}/test_swiglu_fp8.py",),
    ),
    Mutant(
        "fp8-mlp-bias-backward-dh-quantized-twice",
        "with biases (the unfused FP8 backward) fc1's wgrad reads dh quantized from its "
        "dequantized (1, 128) form, not from dh",
        "packages/modules/src/groupgrad/modules/_mlp_forms.py",
        '        dh_dgrad, dh_wgrad = self.grad(dh_T2F, splits, "fc1", rows=dx, tokens=fc1_trains)',
        '        dh_dgrad, dh_wgrad = self.grad(dh_T2F, splits, "fc1", rows=dx, tokens=fc1_trains)\n'
        "        if fc1_trains and dh_dgrad is not None:\n"
        "            dh_wgrad = self.fc1.quantize_tokens(\n"
        '                dh_dgrad.dequantize().to(dh_T2F.dtype), splits, "dh")',
        (f"{MODULES}/test_mlp_matrix.py",),
    ),
    Mutant(
        "fp8-mlp-fc2-cache-never-refreshed",
        "is_first_microbatch=True re-quantizes fc1's weights but reuses fc2's cache: after a "
        "write through .data (an optimizer's) fc2 runs on stale FP8 weights",
        "packages/modules/src/groupgrad/modules/_mlp_fn.py",
        "    fc2 = fp8_for_forward(fp8_recipe, caches[1], is_first_microbatch, keep",
        "    fc2 = fp8_for_forward(fp8_recipe, caches[1], is_first_microbatch and False, keep",
        (f"{MODULES}/test_fp8_mlp.py",),
    ),
    # --- routed_grouped_mlp (gather, fused MLP, combine as one op)
    Mutant(
        "routed-keeps-fc1-output",
        "routed_grouped_mlp's backward keeps fc1's output until it returns (peak memory up by h)",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "        t.untyped_storage().resize_(0)",
        "        pass",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "routed-fc1-checked-after-fc2-written",
        "compiled, routed_grouped_mlp writes fc2's .grad before it refuses a hook on an fc1 "
        "weight (half a refused backward lands)",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "[a_SF], splits, None, ahead=[fc1])",
        "[a_SF], splits, None)",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "layers-ahead-not-checked-for-hooks",
        "the hook refusal skips the layers a later call hands over (routed fc1 under compile)",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    every = [*layers, *ahead]\n",
        "    every = list(layers)\n",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "compiled-op-drops-the-layers-ahead",
        "the compiled op binds the layers ahead but checks only its own",
        _COMPILED,
        "bias_dys=bias_dys, compiled=True, ahead=ahead",
        "bias_dys=bias_dys, compiled=True",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "routed-router-grads-in-expert-order",
        "routed_grouped_mlp returns the router weights' gradient in expert (slot-sorted) order",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "        dweights_Tk = flat.index_copy_(0, slots_S, dprobs_S).view(shape)",
        "        dweights_Tk = flat.copy_(dprobs_S).view(shape)",
        (f"{MODULES}/test_routed.py",),
    ),
    Mutant(
        "fsdp2-fp8-weights-cached-across-forwards",
        "FP8 layers under FSDP cache their gathered weights for is_first_microbatch (an FP8 copy "
        "of each unsharded weight outlives the reshard; after an optimizer step the old "
        "weights can be served)",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        "    return None if fsdp_managed(module) else cache",
        "    return cache",
        (f"{MODULES}/test_fp8_linear.py", "integrations/fsdp2/tests/test_fsdp2_fp8.py"),
    ),
    Mutant(
        "fp8-cache-stamps-without-strides",
        "the FP8 weight cache compares pointer, version and shape only: a square weight "
        "transposed in place (w.data = w.data.t()) is served stale",
        "packages/modules/src/groupgrad/modules/_fp8_cache.py",
        "    return [(p.data_ptr(), p._version, p.shape, p.stride()) for p in params]",
        "    return [(p.data_ptr(), p._version, p.shape, ()) for p in params]",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "hf-fp8-experts-run-bf16",
        'transformers\' "groupgrad_fp8" experts run their GEMMs in bf16 (FP8 asked for, not used)',
        "integrations/transformers/src/groupgrad/integrations/transformers/_forward.py",
        '    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, "blockwise")',
        "    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, None)",
        ("integrations/transformers/tests/test_fp8_experts.py",),
    ),
    Mutant(
        "megatron-fsdp-fp8-weights-cached",
        "Megatron-FSDP parameters served from the FP8 weight cache (ZeRO-1 rewrites them in "
        "place, unseen: is_first_microbatch=False after an optimizer step reads the old weights)",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        "        if is_distributed_weight(params[0]) or is_fsdp_param(params[0]):",
        "        if is_distributed_weight(params[0]):",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "megatron-fp8-flag-ignored",
        "Megatron's fused experts ignore the is_first_microbatch attribute Megatron's schedule sets "
        "(always reuse the FP8 weight cache): after DistributedOptimizer.step(), which moves no "
        "version counter, the next forward reads the old weights",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_experts.py",
        "        return bool(flag)",
        "        return False",
        ("integrations/megatron_core/tests/test_megatron_fp8.py",),
    ),
    Mutant(
        "fp8-wgrad-adds-when-overwriting",
        "an overwriting fp32 FP8 wgrad runs the kernel that adds by TMA reduce-add (main_grad "
        "would keep its old values under the new gradient)",
        "kernels/src/groupgrad/kernels/_cutlass.py",
        "    if accumulate and adding is not None and tokens_per_expert",
        "    if adding is not None and tokens_per_expert",
        ("kernels/tests/test_build.py",),
    ),
    Mutant(
        "fp8-wgrad-packed-is-one-expert",
        "the fp32 FP8 wgrad counts a packed (E, N, K) output as one expert and picks the "
        "reduce-add kernel where many short experts make it 0.7-0.9x slower",
        "kernels/src/groupgrad/kernels/_cutlass.py",
        "        per_expert = tokens / group_size(out)",
        "        per_expert = tokens / len(out)",
        ("kernels/tests/test_build.py",),
    ),
    Mutant(
        "fp8-weights-never-kept",
        "the default FP8 forward keeps nothing for dgrad: every step quantizes the weights twice",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        "        return Fp8Blockwise(held={} if keep_weights else None)",
        "        return Fp8Blockwise(held=None)",
        (f"{MODULES}/test_fp8_linear.py", f"{MODULES}/test_fp8_mlp.py"),
    ),
    Mutant(
        "fp8-distributed-weights-kept",
        "a DistributedWeight group's quantized weights kept from forward to backward (the group "
        "gathers per use to save that memory)",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        "            cache = held = None",
        "            cache = None",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "fp8-weights-kept-under-fsdp2",
        "a layer under FSDP2's fully_shard keeps its quantized weights until backward (FSDP2 frees "
        "the gathered weights after forward: the FP8 copy would undo that)",
        _GROUP,
        " and not fsdp_managed(module)\n",
        "\n",
        ("integrations/fsdp2/tests/test_fsdp2_fp8.py",),
    ),
    Mutant(
        "fp8-splits-compared-with-the-live-object",
        "the FP8 wgrad compares its splits with the object the operands were quantized with "
        "(refilled since) instead of the counts their blocks were cut by",
        "kernels/src/groupgrad/kernels/_validate.py",
        '        if offsets is not None and offsets.device.type == "cpu":\n            own_counts',
        "        if False:\n            own_counts",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-hand-built-offsets-unchecked",
        "a hand-built (128, 1) form's seg_offsets and block_offsets are taken as they are (the "
        "reference reads experts into shared columns, or past its tensors)",
        "kernels/src/groupgrad/kernels/_validate.py",
        "and torch.equal(got, want)):\n",
        "and torch.equal(got, got)):\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-reference-wgrad-of-other-counts",
        "the FP8 wgrad's reference op computes a wgrad over experts its operands' blocks straddle "
        "(the CUDA setup makes every output NaN)",
        "kernels/src/groupgrad/kernels/_fp8_gemm.py",
        '        dw.masked_fill_(cut_otherwise.to(dw.device), float("nan"))',
        "        pass",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-source-dtype-unchecked",
        "an Fp8Blocks claiming any source dtype (int32, bool) sets fprop's output dtype",
        "kernels/src/groupgrad/kernels/_validate.py",
        "    if value.dtype not in _rules.INPUT_DTYPES:  # fprop/dgrad return it",
        "    if False:",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-blind-to-in-place-changes",
        "a sealed Fp8Blocks whose tensor was changed in place (transposed, resized) or given "
        "fewer rows through `.data =` keeps its seal: the kernels read another layout than they expect",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "            state += (t.data_ptr(), t.shape, t.stride(), t.dtype)",
        "            state += (t.data_ptr(), t.dtype)",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "kernels-record-nothing-silently",
        "a GEMM given inputs autograd records (grad mode on) runs, and its output carries no "
        "gradient back to them: the inputs silently get none",
        "kernels/src/groupgrad/kernels/_rules.py",
        "    if not torch.is_grad_enabled():\n        return\n    for name, value in inputs:",
        "    if True:\n        return\n    for name, value in inputs:",
        (f"{KERNELS}/test_validation.py", f"{KERNELS}/test_fp8_gemm.py"),
    ),
    Mutant(
        "kernels-refuse-recorded-members-only-when-alike",
        "a listed group whose members are not alike (a strided member) is not checked for "
        "members autograd records",
        "kernels/src/groupgrad/kernels/_rules.py",
        "            recorded = _group.any_requires_grad(value)",
        "            recorded = False",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "fp8-seal-blind-to-other-memory",
        "a sealed Fp8Blocks whose tensor was replaced by another, or given other memory through "
        "`.data =`, keeps its seal (the address facts the validator checked go unchecked)",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "            state += (t.data_ptr(), t.shape, t.stride(), t.dtype)",
        "            state += (t.shape, t.stride(), t.dtype)",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-blind-to-dtype",
        "a sealed Fp8Blocks whose scales were given another dtype through `.data =` (a view of "
        "the same memory) keeps its seal: the reference reads the bits as int32 values",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "            state += (t.data_ptr(), t.shape, t.stride(), t.dtype)",
        "            state += (t.data_ptr(), t.shape, t.stride())",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-blind-to-the-row-offsets",
        "a sealed (128, 1) Fp8Blocks whose row_offsets were replaced (int32 ones) keeps its "
        "seal: the GEMMs read its token counts from a tensor nobody checked",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "    for t in (form.data, form.data_t, form.scales, form.row_offsets):",
        "    for t in (form.data, form.data_t, form.scales):",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-of-fake-forms",
        "forms of fake tensors are sealed: their addresses are read (a deprecation warning "
        "now, an error in later torch)",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "        if set(map(type, tensors)) <= _SEALABLE:",
        "        if True:",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-blind-to-the-shape",
        "a sealed Fp8Blocks given another shape keeps its seal: its tensors are not checked "
        "against the new shape's layout",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "    state: list[Any] = [form.block, form.shape]",
        "    state: list[Any] = [form.block]",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-scales-placement-unchecked",
        "an FP8 operand's misaligned scales go to CUTLASS, whose entry does not check their "
        "address, instead of the reference path",
        "kernels/src/groupgrad/kernels/_support.py",
        "    for name, t in scales:\n",
        "    for name, t in scales[:0]:\n",
        (f"{KERNELS}/test_support.py",),
    ),
    Mutant(
        "fp8-dgrad-out-over-transposed-weights",
        "an FP8 dgrad's out may share memory with the transposed weights its kernel reads (the "
        "forward orientation is compared instead)",
        "kernels/src/groupgrad/kernels/_validate.py",
        '(w8.data, data_t) if op == "fprop" else (data_t, w8.data)',
        "(w8.data, w8.data)",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-row-out-over-scales",
        "an FP8 fprop/dgrad's out may share memory with its operands' scales",
        "kernels/src/groupgrad/kernels/_validate.py",
        '(f"{a_name}.scales", a8.scales), (f"{w_name}.scales", w8.scales), (w_name',
        "(w_name",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-wgrad-out-over-scales",
        "an FP8 wgrad's out (packed or listed) may share memory with its operands' scales",
        "kernels/src/groupgrad/kernels/_validate.py",
        '    scales = [("dy.scales", dy8.scales), ("x.scales", x8.scales)]\n',
        "    scales = []\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-cheap-row-out-ignores-scales",
        "the cheap test of an FP8 fprop/dgrad's out forgets the operands' scales: an out over "
        "them passes unchecked and the GEMM overwrites the scales it reads",
        _RULES,
        "(out_TX, (a, w_group[0], *[t for _, t in also]))",
        "(out_TX, (a, w_group[0]))",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-cheap-wgrad-out-ignores-scales",
        "the cheap test of a packed FP8 wgrad's out forgets the operands' scales: an out over "
        "them passes unchecked",
        _RULES,
        "(out, (dy, x, *[t for _, t in also]))",
        "(out, (dy, x))",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "reentrant-regions-count-as-backwards",
        "a layer used in two regions of a reentrant checkpoint counts each region's nested "
        "graph task as a backward: a second backward_dw() job, the second use overwriting the "
        "first's main_grad",
        "packages/modules/src/groupgrad/modules/_tasks.py",
        "    while task in _OUTER_TASK:\n",
        "    while False:\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "nested-regions-resolved-once",
        "the task a wgrad rule recorded is compared as it was resolved then: an inner reentrant "
        "region's GEMM, run before the outer region's own use tells whose backward the outer "
        "region's task is, counts as another backward",
        "packages/modules/src/groupgrad/modules/_tasks.py",
        "backward_of(first) == backward_of(second)",
        "first == backward_of(second)",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "linear-backward-forgets-its-outer-task",
        "GroupedLinear's backward does not name the backward its reentrant checkpoint nests it in",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "        enter_backward(ctx.forward_task)\n",
        "",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "mlp-backward-forgets-its-outer-task",
        "GroupedMLP's backward does not name the backward its reentrant checkpoint nests it in",
        "packages/modules/src/groupgrad/modules/_mlp_fn.py",
        "        enter_backward(ctx.forward_task)\n",
        "",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "compiled-op-refuses-autograd-grad-of-main-grad-weights",
        "the compiled op refuses torch.autograd.grad over a weight whose gradient it never "
        "returns to autograd (main_grad without a dummy), where eager writes main_grad",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "    weights = not queued and layer.target.route() is WgradRoute.AUTOGRAD\n",
        "    weights = True\n",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "compiled-op-checks-after-writing",
        "the compiled op checks the traced dummies and torch.autograd.grad's requests after the "
        "wgrads were written into main_grad (or queued): a refused step leaves them written, "
        "and retrying it as the message says adds them twice",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "    with autograd_dispatch():\n        delivered = _check_before_writing(layers, dummies, wgrad_queue is not None)\n    if wgrad_queue is not None:  # kept for backward_dw(): the compiled graph reuses its buffers\n        operands = [t.clone() for t in operands]\n        splits = None if splits is None else splits.clone()\n    counted = splits if splits is not None else tuple(counts or ())\n    stream = iter(operands)\n    taken = [part.take(stream, tokens, counted) for part in parts]\n    dys, xs = [t[0] for t in taken], [t[1] for t in taken]\n    bias_dys = [t[2] for t in taken if t[2] is not None] or None\n    answers = parameter_grads(\n        layers, dys, xs, counted, wgrad_queue, bias_dys=bias_dys, compiled=True, ahead=ahead\n    )\n    with autograd_dispatch():\n        _deliver(layers, answers, delivered)\n",
        "    if wgrad_queue is not None:  # kept for backward_dw(): the compiled graph reuses its buffers\n        operands = [t.clone() for t in operands]\n        splits = None if splits is None else splits.clone()\n    counted = splits if splits is not None else tuple(counts or ())\n    stream = iter(operands)\n    taken = [part.take(stream, tokens, counted) for part in parts]\n    dys, xs = [t[0] for t in taken], [t[1] for t in taken]\n    bias_dys = [t[2] for t in taken if t[2] is not None] or None\n    answers = parameter_grads(\n        layers, dys, xs, counted, wgrad_queue, bias_dys=bias_dys, compiled=True, ahead=ahead\n    )\n    with autograd_dispatch():\n        delivered = _check_before_writing(layers, dummies, wgrad_queue is not None)\n        _deliver(layers, answers, delivered)\n",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "fp8-recipe-set-later-unchecked",
        "a layer's fp8_recipe set after construction to an unsupported value runs the "
        "blockwise recipe silently",
        "packages/modules/src/groupgrad/modules/_fp8_recipe.py",
        "    if check_fp8_recipe(fp8_recipe) is None:\n        return None\n",
        "    if fp8_recipe is None:\n        return None\n",
        (f"{MODULES}/test_fp8_linear.py", f"{MODULES}/test_fp8_mlp.py"),
    ),
    Mutant(
        "fp8-seal-calls-every-form-placed",
        "a seal calls its form placed without reading its addresses: a form given misaligned "
        "scales or data skips the support check and reaches the kernels' entry, which refuses "
        "it (an error where the reference path served the call)",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "            seal[2] = find(self)\n",
        "            seal[2] = True\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-unsealable-form-keeps-its-old-seal",
        "a sealed form given a tensor it cannot seal keeps its old seal, whose placement fact "
        "no longer describes its tensors",
        "kernels/src/groupgrad/kernels/_fp8.py",
        "        else:\n            self._seal = None\n",
        "",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-placed-skips-out",
        "operands found placed spare out its support check too: a misaligned or "
        "non-contiguous out reaches the kernels",
        "kernels/src/groupgrad/kernels/_support.py",
        "    reason = None if placed else _operands_reason(data, scales, device)\n"
        "    if reason is not None:\n",
        "    reason = None if placed else _operands_reason(data, scales, device)\n"
        "    if placed or reason is not None:\n",
        (f"{KERNELS}/test_support.py",),
    ),
    Mutant(
        "fp8-placement-skips-transposed-data",
        "a seal calls a weight form placed without its transposed data, which dgrad reads",
        "kernels/src/groupgrad/kernels/_fp8_gemm.py",
        "    data = [form.data] if form.data_t is None else [form.data, form.data_t]\n",
        "    data = [form.data]\n",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-seal-skips-the-gemm-rules",
        "a sealed Fp8Blocks skips the GEMMs' shape rules before they were found to hold for it: "
        "a quantized form no GEMM takes (no expert, a 2-D weight) reaches the kernels",
        "kernels/src/groupgrad/kernels/_validate.py",
        "    if seal and seal[1]:",
        "    if seal:",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-weight-scales-strides-unchecked",
        "the weights' scales are taken with any strides (stride 0: one expert's scales for all)",
        "kernels/src/groupgrad/kernels/_validate.py",
        '("scales", (E, N // 128, K // 128), (N * K // 16384, K // 128, 1), _F32)',
        '("scales", (E, N // 128, K // 128), None, _F32)',
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "backward-dw-refusal-drops-the-job",
        "a backward_dw() refused by a main_grad check drops its job (the gradient lost, the "
        "hooks held for good) instead of keeping it for a retry",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "            self._jobs.appendleft(job)\n            raise",
        "            raise",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "backward-dw-with-grad-on",
        "backward_dw() runs its GEMMs with grad on: a main_grad that requires grad, written by "
        "backward, is refused there",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "        with no_autocast(operand_device(job[0].dy_TN)), torch.no_grad():",
        "        with no_autocast(operand_device(job[0].dy_TN)):",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "weights-edited-before-backward-unchecked",
        "a weight modified in place between forward and backward is read by the dgrad (the "
        "gradient of values the forward never saw) instead of a RuntimeError",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "    if versions is None:\n        return\n    for name, w, version",
        "    if True:\n        return\n    for name, w, version",
        (f"{MODULES}/test_silent_wrong_gradients.py", f"{MODULES}/test_fp8_linear.py"),
    ),
    Mutant(
        "mlp-fc2-weights-unchecked",
        "GroupedMLP's backward reads fc2's weights as edited after forward",
        "packages/modules/src/groupgrad/modules/_mlp_fn.py",
        "    check_forward_versions(layout.fc2, w2, ctx.versions[1])",
        "    pass",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fp8-cache-blind-to-optimizer-steps",
        "a cached FP8 weight outlives a fused torch.optim step (no version bump, same pointer)",
        "packages/modules/src/groupgrad/modules/_fp8_cache.py",
        "            and self.steps == _STEPS[0]\n",
        "",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "second-derivative-silently-zero",
        "under create_graph=True a grouped op's gradients come back as constants: a gradient "
        "penalty or Hessian-vector product through it silently lacks the op's terms",
        "packages/modules/src/groupgrad/modules/_once.py",
        "            if torch.compiler.is_compiling() or not torch.is_grad_enabled():",
        "            if True:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "second-derivative-guard-only-where-grads-record",
        "the second-derivative guard wraps only gradients that already record a graph (none do: "
        "the kernels' results), so it never fires",
        "packages/modules/src/groupgrad/modules/_once.py",
        "            given = [g.detach().requires_grad_() for g",
        "            given = [g.detach() for g",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "wgrad-runs-for-an-input-only-backward",
        "torch.autograd.grad(loss, [x]) or backward(inputs=[x]) runs the wgrad GEMMs anyway: "
        "main_grad (or a backward_dw() job) gets a gradient nobody asked for",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    taken = [state is not False for state in states]",
        "    taken = [True for state in states]",
        (f"{MODULES}/test_silent_wrong_gradients.py", _COMPILE_TESTS),
    ),
    Mutant(
        "wgrad-runs-for-some-of-a-layers-weights",
        "backward(inputs=[weight0]) or torch.autograd.grad(loss, [weight0]) runs the layer's one "
        "GEMM past autograd for every member: weight1's main_grad (or backward_dw() job) gets a "
        "gradient nobody asked for",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    if all(taken) or not any(taken):\n        return taken[0]",
        "    if True:\n        return any(taken)",
        (f"{MODULES}/test_silent_wrong_gradients.py", _COMPILE_TESTS),
    ),
    Mutant(
        "distributed-group-delivered-in-part",
        "a backward naming some of a distributed group's weights runs its one GEMM and the "
        "leader's finalize for all of them",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    past = queued or target.spec.wgrad_into_main_grad or target.route() is WgradRoute.DISTRIBUTED",
        "    past = queued or target.spec.wgrad_into_main_grad",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "some-weights-refused-where-autograd-takes-the-wgrads",
        "the all-or-none rule applied where the wgrads go back to autograd (which keeps only "
        "those asked for): one expert's gradient asked of a plain layer is refused",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "        if not live or not past:",
        "        if not live:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "compiled-some-weights-refused-where-autograd-takes-the-wgrads",
        "under torch.compile the all-or-none rule applied where the wgrads go to .grad: one "
        "expert's gradient asked of a plain layer is refused",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "        if not trainable or not past:",
        "        if not trainable:",
        (_COMPILE_TESTS,),
    ),
    Mutant(
        "mlp-delivery-read-off-the-other-layers-nodes",
        "the fused MLP reads fc1's weights' delivery off fc2's gradient nodes: a backward asking "
        "for fc1's gradients writes fc2's main_grads and leaves fc1's",
        "packages/modules/src/groupgrad/modules/_mlp_fn.py",
        "fc1_nodes, _, fc2_nodes, _ = gradient_nodes(ctx, w1, b1, w2, b2)",
        "fc2_nodes, _, fc1_nodes, _ = gradient_nodes(ctx, w1, b1, w2, b2)",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "one-expert-buffer-as-packed-out",
        "a one-expert group's single (N, K) wgrad buffer handed to the GEMM as its packed "
        "(E, N, K) out, as a packed weight's is: every one-expert layer's backward fails",
        _PLAN,
        "if len(self.weights) == 1 and self.weights[0].ndim == 3:",
        "if len(self.buffers) == 1:",
        (f"{PROTOCOL}/test_plan.py", f"{MODULES}/test_linear_matrix.py"),
    ),
    Mutant(
        "overwrite-record-weakly-kept",
        "the record of which backward overwrote a parameter's main_grad kept through a weak "
        "reference to the parameter: torch.utils.swap_tensors (module.to() with torch's swap "
        "on) refuses it after a step",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "            setattr(param, _WRITTEN_FOR, (_PROCESS, task))\n",
        "            setattr(param, _WRITTEN_FOR, (_PROCESS, task))\n"
        "            __import__('weakref').finalize(param, int)\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "overwrite-rule-per-group",
        "a GEMM into main_grads of which an earlier GEMM of the same backward wrote some (a "
        "weight shared by two groups) overwrites them all: the shared weight loses the earlier "
        "GEMM's gradient",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "    if not any(written):\n",
        "    if not all(written):\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "deferred-job-forgets-its-backward",
        "backward_dw() plans a deferred GEMM for no backward: two layers sharing a weight, "
        "each run by its own backward_dw(), both overwrite its main_grad",
        _WGRAD,
        "deferred=True, task=self.task, pending=pending",
        "deferred=True, task=-1, pending=pending",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "shared-weight-hooks-run-per-layer",
        "a deferred parameter's hooks run after the last GEMM of its own layer's job: a weight "
        "shared by two delayed layers runs them after each layer's backward_dw(), the first "
        "time on part of the gradient",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "        tasks.append(task)\n",
        "        tasks.append(task) if param.dim() > 99 else None\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "distributed-overwrite-second-use-silent",
        "a distributed layer used twice in one backward with overwrite_main_grad runs both "
        "GEMMs: its finalize overwrites main_grad with each, keeping the last use's gradient",
        _WGRAD,
        "                refuse_distributed_rewrite(plan, task, pending)\n",
        "                pass\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "deferred-run-plans-for-no-backward",
        "backward_dw() plans a GEMM it did not ready (a distributed group's) for no backward: "
        "a distributed layer used twice with overwrite_main_grad is not refused when delayed",
        _WGRAD,
        "ready = self.ready(dy_TN, x_TK, splits, plan, task)",
        "ready = self.ready(dy_TN, x_TK, splits, plan)",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fsdp2-mlp-halves-as-units-misnamed",
        "fc1 and fc2 of a GroupedMLP sharded as FSDP2 units of their own are refused as "
        "'already a DTensor' (a tensor-parallel message), not as units the fused op never runs",
        "integrations/fsdp2/src/groupgrad/integrations/fsdp2/_validate.py",
        "            if inner:\n",
        "            if False:\n",
        ("integrations/fsdp2/tests/test_validation.py",),
    ),
    Mutant(
        "raising-hook-keeps-later-holds",
        "a post-accumulate-grad hook that raises in backward_dw() leaves the holds of the "
        "parameters after it in place for good: autograd never runs their hooks again",
        "packages/protocol/src/groupgrad/protocol/_hooks.py",
        "        release_post_accumulate_grad_hooks(param for param, _, _ in live[released:])",
        "        pass",
        (f"{PROTOCOL}/test_plan.py", f"{MODULES}/test_silent_wrong_gradients.py"),
    ),
    Mutant(
        "run-hooks-flags-misapplied",
        "per-parameter run_hooks flags ignored: every parameter's hooks run, a shared weight's "
        "after its first deferred GEMM too",
        "packages/protocol/src/groupgrad/protocol/_hooks.py",
        "                if hooks:\n",
        "                if run_hooks:\n",
        (f"{PROTOCOL}/test_plan.py", f"{MODULES}/test_silent_wrong_gradients.py"),
    ),
    Mutant(
        "raising-deferred-gemm-keeps-holds",
        "a deferred GEMM that raises (out of memory) in backward_dw() leaves its parameters' "
        "hooks held for good",
        _WGRAD,
        "            release_post_accumulate_grad_hooks(p for p in self.params if p.requires_grad)\n",
        "            pass\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "raising-deferred-job-keeps-later-holds",
        "a deferred job whose GEMM or hook raises leaves its GEMMs not run yet queued and "
        "their parameters' hooks held for good",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "                _drop(job[index + 1 :])\n",
        "                pass\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "hf-fp8-sizes-named-by-internals",
        "a transformers model whose hidden size or expert width is not a multiple of 128 under "
        "'groupgrad_fp8' is refused naming an internal operand, not the module, its sizes and "
        "'groupgrad' to use instead",
        "integrations/transformers/src/groupgrad/integrations/transformers/_forward.py",
        "    if bad:\n",
        "    if False:\n",
        ("integrations/transformers/tests/test_fp8_experts.py",),
    ),
    Mutant(
        "swiglu-ref-twin-unchecked",
        "swiglu_probs_ref broadcasts a probs of the wrong shape over every token (and truncates "
        "an integer h) instead of the public op's named error",
        "kernels/src/groupgrad/kernels/_swiglu.py",
        "    check_swiglu_args(h_T2F, probs_T, oracle=True)\n",
        "",
        (f"{KERNELS}/test_swiglu.py",),
    ),
    Mutant(
        "swiglu-backward-ref-twin-unchecked",
        "swiglu_probs_backward_ref broadcasts a da or probs of the wrong shape over every token "
        "instead of the public op's named error",
        "kernels/src/groupgrad/kernels/_swiglu.py",
        "    check_swiglu_backward_args(da_TF, h_T2F, probs_T, oracle=True)\n",
        "",
        (f"{KERNELS}/test_swiglu.py",),
    ),
    Mutant(
        "non-strided-operand-unnamed",
        "a sparse, mkldnn or nested operand reaches torch's internals or the reference kernel "
        "(an error about data pointers) instead of a TypeError naming it",
        _KERNEL_GROUP,
        "    return torch.compiler.is_compiling() or _strided(t)",
        "    return True",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "layout-read-while-tracing",
        "the operand check reads Tensor.layout while Dynamo traces a backward: every layer "
        "whose input requires grad fails to compile with fullgraph=True",
        _KERNEL_GROUP,
        "    return torch.compiler.is_compiling() or _strided(t)",
        "    return _strided(t)",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "fp8-form-missing-tensor-unnamed",
        "a hand-built Fp8Blocks without data or scales fails with an AttributeError from "
        "inside the validator",
        "kernels/src/groupgrad/kernels/_validate.py",
        "    kinds = [t.dtype if isinstance(t, Tensor) else type(t).__name__ for t in (data, scales)]",
        "    kinds = [data.dtype, scales.dtype]",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "fp8-tampered-offsets-unnamed",
        "a quantized (128, 1) form whose seg_offsets were replaced by a non-tensor fails in "
        "torch.equal instead of a message naming the part",
        "kernels/src/groupgrad/kernels/_validate.py",
        "        if not (isinstance(got, Tensor) and got.device == want.device and torch.equal(got, want)):",
        "        if not torch.equal(got, want):",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "evaluation-compile-through-apply",
        "grad mode off, the grouped Functions run through apply, where Dynamo binds their "
        "variadic parameters wrongly: a fullgraph compile of an evaluation step fails",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "    if not torch.is_grad_enabled():  # no backward follows: see _no_grad\n",
        "    if False:\n",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "routed-evaluation-compile-through-apply",
        "grad mode off, routed_grouped_mlp runs through apply, where Dynamo binds its variadic "
        "parameters wrongly: a fullgraph compile of an evaluation step fails",
        "packages/modules/src/groupgrad/modules/_routed.py",
        "    if not torch.is_grad_enabled():  # no backward follows: see _no_grad\n",
        "    if False:\n",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "backward-dw-after-frozen-backward-raises",
        "backward_dw() after a backward whose layer had every weight frozen raises 'no backward "
        "has queued' (Megatron's delayed-wgrad schedule stopped at step 1)",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "        self._idle_backward = not job\n",
        "        self._idle_backward = False\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "backward-dw-idle-answered-forever",
        "once a backward deferred nothing, every later backward_dw() without a job passes "
        "silently (a call with no backward before it is not refused)",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "            self._idle_backward = False\n            return\n",
        "            return\n",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "unfused-moe-act-without-te-unchecked",
        "Megatron's TEGroupedMLP with groupgrad linears is built with 'moe_act' recompute and "
        "no Transformer Engine, and stops at the first forward with a NameError",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_config.py",
        '    if getattr(config, "recompute_granularity", None) != "selective" or "moe_act" not in modules:',
        "    if True:",
        ("integrations/megatron_core/tests/test_specs_and_config.py",),
    ),
    Mutant(
        "ddp-delay-unrefused",
        "a delayed layer inside PyTorch's DistributedDataParallel runs: backward_dw() delivers "
        "each rank's own weight gradient, never averaged",
        "packages/modules/src/groupgrad/modules/_base.py",
        "    if weights:\n        raise RuntimeError(",
        "    if False:\n        raise RuntimeError(",
        (f"{MODULES}/test_ddp.py",),
    ),
    Mutant(
        "ddp-delay-refused-for-ignored-weights",
        "a delayed layer whose weights DDP ignores (the user reduces them) is refused all the same",
        "packages/modules/src/groupgrad/modules/_base.py",
        "        weights = [(name, p) for name, p in weights if id(p) in ids]\n",
        "",
        (f"{MODULES}/test_ddp.py",),
    ),
    Mutant(
        "backward-dw-after-forward-without-grad-raises",
        "a delayed layer whose forward needed no grad (every weight frozen, an input that needs "
        "none) has its backward_dw() raise 'no backward has queued'",
        "packages/modules/src/groupgrad/modules/_base.py",
        "        if self.delay_wgrad_compute and torch.is_grad_enabled() and not out.requires_grad:",
        "        if False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fsdp2-flag-switched-after-sharding-unchecked",
        "delay_wgrad_compute or accumulate_into_main_grad switched on after fully_shard: the "
        "weight gradient misses FSDP2's reduce-scatter (the sharded .grad stays None)",
        "integrations/fsdp2/src/groupgrad/integrations/fsdp2/_shard.py",
        "    if layers := groupgrad_layers(modules):",
        "    if False:",
        ("integrations/fsdp2/tests/test_validation.py",),
    ),
    Mutant(
        "masters-state-not-restored",
        "MasterWeights.load_state_dict copies nothing: a resumed run restarts from other fp32 "
        "masters than the saved ones",
        "integrations/torch_distributed/src/groupgrad/integrations/torch_distributed/_master.py",
        "        for value, master in zip(saved, self.master_params, strict=True):\n            master.copy_(value)",
        "        pass",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "masters-of-another-rank-loaded",
        "MasterWeights.load_state_dict takes another rank's file (same shapes, other rows)",
        "integrations/torch_distributed/src/groupgrad/integrations/torch_distributed/_master.py",
        '        if state["rank"] != rank:',
        "        if False:",
        (f"{TORCH_DISTRIBUTED}/test_training_loop.py",),
    ),
    Mutant(
        "fetched-main-grad-ignored",
        "plan_weight_grads calls get_main_grad() again for a member the caller fetched a "
        "buffer for in this backward",
        _PLAN,
        "    fetched = {i: known[i] if i in known else fetch_main_grad(members[i], labels[i]) for i in live}",
        "    fetched = {i: fetch_main_grad(members[i], labels[i]) for i in live}",
        (f"{PROTOCOL}/test_plan.py",),
    ),
    Mutant(
        "get-main-grad-per-gemm",
        "a layer used twice in one backward calls get_main_grad() for each GEMM: an owner "
        "handing out a fresh buffer per call gets the second use added into garbage",
        _WGRAD,
        "            fetched=fetched_for(self.params, task) if task >= 0 else None,",
        "            fetched=None,",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fetched-main-grads-kept-past-backward",
        "the main_grad buffers a backward took are never forgotten: the next backward writes "
        "the previous one's buffers instead of calling get_main_grad()",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "            Variable._execution_engine.queue_callback(lambda: forget_fetched(running))",
        "            pass",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "deferred-fetched-main-grads-leak",
        "the main_grad buffers a deferred job took are kept after the job ran (one set per "
        "backward, for as long as the process lives)",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "                forget_fetched(job[0].task)",
        "                pass",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "failed-backward-main-grads-kept",
        "the main_grad buffers a backward took before it raised are kept for good (no callback "
        "runs for a backward that raised), one set per failed backward",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "        for key in [key for key in _FETCHED if key not in mine]:",
        "        for key in []:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fp8-linear-x-tokens-form-always",
        "an FP8 linear forward writes x's (128, 1) form where no wgrad will read it (grad off, "
        "every weight frozen): a needless quantization",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "                x_gemm, x_saved = fp8.quantize_input(x_TK, splits, tokens=tokens)",
        "                x_gemm, x_saved = fp8.quantize_input(x_TK, splits, tokens=True)",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "fp8-x-tokens-form-under-no-grad",
        "an FP8 forward with grad off writes x's (128, 1) form for a wgrad that never runs",
        "packages/modules/src/groupgrad/modules/_no_grad.py",
        "    return not isinstance(ctx, _NoBackward) and any(w.requires_grad for w in weights)",
        "    return any(w.requires_grad for w in weights)",
        (f"{MODULES}/test_fp8_mlp.py", f"{MODULES}/test_fp8_linear.py"),
    ),
    Mutant(
        "fp8-x-tokens-form-never",
        "an FP8 linear forward never writes x's (128, 1) form: the wgrad gets bf16 x with FP8 dy",
        "packages/modules/src/groupgrad/modules/_linear_fn.py",
        "                tokens = wgrad_follows(ctx, weights)",
        "                tokens = False",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "delayed-derived-weight-accepted",
        "a weight a parametrization computes is accepted with delay_wgrad_compute: "
        "backward_dw() adds its gradient into the throw-away tensor's .grad, the parameter "
        "never gets one",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "        for param in delayed:",
        "        for param in ():",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "derived-weight-main-grad-hint-lost",
        "a parametrized weight under accumulate_into_main_grad is named as lacking a main_grad, "
        "without saying it is computed from the parameter that has one",
        "packages/protocol/src/groupgrad/protocol/_attrs.py",
        "            if param.is_leaf",
        "            if True",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "dummy-alias-kept-at-hand-out",
        "a .grad that is an alias of the shared dummy is kept when dummies are handed out: a "
        "penalty's gradient on one weight is added into every same-shaped weight's .grad",
        _PLAN,
        "    drop_dummy_grads(p for p in members if p.requires_grad)\n    handed:",
        "    pass\n    handed:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "dummy-alias-kept-on-autograd-route",
        "the plain route hands autograd its gradients while .grad is still an alias of the "
        "shared dummy (main_grad switched off): every expert's .grad gets the sum",
        _PLAN,
        "            drop_dummy_grads(\n"
        "                p for p, keep in zip(self.weights, self.trainable, strict=True) if keep\n"
        "            )",
        "            pass",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "dummy-alias-added-into-by-deferred-job",
        "a deferred job adds its gradient into a .grad that is an alias of the shared dummy: "
        "every same-shaped weight gets it",
        "packages/protocol/src/groupgrad/protocol/_hooks.py",
        "    own_dummy_grads(p for p, g, _ in live if g is not None)  # never add into a shared dummy",
        "    pass",
        (f"{PROTOCOL}/test_plan.py",),
    ),
    Mutant(
        "compiled-autograd-undone-grad-accepted",
        "under Compiled Autograd a layer writes .grad (no main_grad, or a bias), which the "
        "graph then sets back to None: every such gradient lost without a word",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "        into_grad = [n for (_, n), takes in zip(live, accumulates, strict=True) if takes]",
        "        into_grad = []",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "compiled-autograd-delay-accepted",
        "a delayed layer under Compiled Autograd: its hooks run at backward on a gradient not "
        "computed yet, and again in backward_dw()",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "    if queued:\n        raise RuntimeError(\n",
        "    if False:\n        raise RuntimeError(\n",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "zero-out-dummy-shared-with-the-others",
        "parameters with and without zero_out_wgrad share one dummy buffer: an unversioned "
        "write into the former's reaches the latter's next hand-out",
        "packages/protocol/src/groupgrad/protocol/_attrs.py",
        "    key = (tuple(param.shape), grad_dtype_of(param), param.device, zero_out)",
        "    key = (tuple(param.shape), grad_dtype_of(param), param.device, False)",
        (f"{PROTOCOL}/test_plan.py",),
    ),
    Mutant(
        "compiled-autograd-refuses-a-dgrad-only-backward",
        "under Compiled Autograd backward(inputs=[x]) is refused for a biased layer although "
        "nothing is written into .grad",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "        into_grad = [n for (_, n), takes in zip(live, accumulates, strict=True) if takes]",
        "        into_grad = [n for (_, n), takes in zip(live, accumulates, strict=True)]",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "compiled-autograd-delay-accepted-without-dynamo",
        "a delayed layer under a Compiled Autograd compiler that is not Dynamo: its hooks run at "
        "backward on an unwritten main_grad, then again in backward_dw()",
        "packages/modules/src/groupgrad/modules/_compiled.py",
        "        if queue is not None and _compiled_autograd_running():",
        "        if False:",
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "deferred-hand-out-keeps-dummy-alias",
        "a delayed layer on the plain route keeps a .grad aliasing the shared dummy at backward: "
        "a penalty on one weight lands in every same-shaped weight's .grad",
        _PLAN,
        "    drop_dummy_grads(p for p in members if p.requires_grad)  # before autograd adds into one",
        "    pass",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "megatron-hooks-of-frozen-weights-run",
        "backward_dw() runs Megatron DDP's hook of a weight frozen after the DDP was built: "
        "its bare `assert param.requires_grad` is all the user sees",
        "integrations/megatron_core/src/groupgrad/integrations/megatron_core/_hooks.py",
        "        if len(self._hooks) <= trainable:\n            return\n",
        "        return\n",
        ("integrations/megatron_core/tests/test_specs_and_config.py",),
    ),
    Mutant(
        "nested-task-forgets-backward-fetched",
        "a reentrant checkpoint region's nested graph task forgets, as it ends, the main_grad "
        "buffers its backward took: a GEMM outside the region calls get_main_grad() again",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "        if running >= 0 and backward_of(running) == running:",
        "        if running >= 0:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "fetched-looked-up-by-task-not-backward",
        "a nested task's plan looks for the buffers its own task took, not its backward's: a "
        "GEMM in a reentrant checkpoint region calls get_main_grad() again",
        "packages/modules/src/groupgrad/modules/_param_records.py",
        "    return [key for key in _FETCHED if backward_of(key) == mine]",
        "    return [key for key in _FETCHED if key == task]",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "mfsdp-delay-switched-after-sharding-unchecked",
        "delay_wgrad_compute switched on after shard_model trains on garbage: Megatron-FSDP "
        "reduces the unwritten bucket at backward, before backward_dw()",
        "integrations/megatron_fsdp/src/groupgrad/integrations/megatron_fsdp/_shard.py",
        "    guard_no_delayed_wgrad(module)\n",
        "",
        ("integrations/megatron_fsdp/tests/test_training.py",),
    ),
    Mutant(
        "fsdp2-unit-hooks-traced",
        "the FSDP2 unit's grad_dtype hook is traced by Dynamo when the sharded unit is compiled "
        "in place: fullgraph=True fails at grad_dtype",
        "integrations/fsdp2/src/groupgrad/integrations/fsdp2/_route.py",
        "    @torch.compiler.disable  # runs outside a compiled unit's graph (see _shard)\n",
        "",
        ("integrations/fsdp2/tests/test_validation.py",),
    ),
    Mutant(
        "fp8-form-carries-a-size",
        "an FP8 operand's form carries the source's columns into the compiled op's constant "
        "layout key: a dynamic-shape trace (dynamic=True, an FSDP2 unit recompiled for another "
        "size) fails",
        "packages/modules/src/groupgrad/modules/_operands.py",
        '        str(operand.dtype).removeprefix("torch."),\n',
        '        str(operand.dtype).removeprefix("torch.") + str(operand.shape[1] * 0)[:0],\n',
        (f"{MODULES}/test_compile.py",),
    ),
    Mutant(
        "fp8-out-over-other-orientation-accepted",
        "an FP8 fprop/dgrad out over the weights' orientation the op does not read is "
        "accepted and overwritten: the other op reads garbage",
        "kernels/src/groupgrad/kernels/_validate.py",
        ", (w_name, w_other)]",
        "]",
        (f"{KERNELS}/test_fp8_gemm.py",),
    ),
    Mutant(
        "gemms-replayed-by-selective-checkpoint",
        "selective activation checkpointing saves and replays the GEMMs' empty return: the "
        "recomputed activations are garbage",
        _OPS,
        "        ignored.update(op._opoverload for op in ops)  # type: ignore[attr-defined]",
        "        pass",
        (f"{MODULES}/test_selective_checkpoint.py",),
    ),
    Mutant(
        "listed-members-not-checked-dense",
        "a listed member that is sparse or mkldnn reaches torch's internals (data pointers, "
        "strides) unnamed",
        _KERNEL_GROUP,
        "        all(map(_strided, tensors))  # eager here: not compiling\n        and ",
        "        ",
        (f"{KERNELS}/test_validation.py",),
    ),
    Mutant(
        "quantizer-takes-recorded-inputs",
        "quantize_fp8 takes an input autograd records: its FP8 data requires grad, a gradient "
        "that never arrives",
        "kernels/src/groupgrad/kernels/_fp8.py",
        '    _rules.check_unrecorded("quantize_fp8", [(name, x)], None)\n',
        "",
        (f"{KERNELS}/test_fp8_gemm.py", f"{KERNELS}/test_fp8_quant.py"),
    ),
    Mutant(
        "swiglu-takes-recorded-inputs",
        "the SwiGLU ops take inputs autograd records: the op's output cannot be differentiated, "
        "its twin's can",
        "kernels/src/groupgrad/kernels/_swiglu.py",
        "    check_unrecorded(op, given, None)",
        "    del op",
        (f"{KERNELS}/test_swiglu.py", f"{KERNELS}/test_swiglu_fp8.py"),
    ),
    Mutant(
        "fp8-list-splits-read-back-from-a-tensor",
        "the FP8 quantizer reads a list's counts back from a tensor: fullgraph compile fails "
        "inside Dynamo",
        "kernels/src/groupgrad/kernels/_fp8.py",
        '    return [operator.index(s) for s in cast("Sequence[Any]", splits)]',
        "    return _rules.splits_arg(splits, rows, T, device, experts=None).tolist()",
        (f"{MODULES}/test_fp8_linear.py",),
    ),
    Mutant(
        "nested-delayed-jobs-not-merged",
        "a backward's delayed uses pushed before a reentrant region's nesting was known stay "
        "two backward_dw() jobs: one lands in the next step",
        "packages/modules/src/groupgrad/modules/_wgrad_queue.py",
        "        while self._jobs and same_backward(job[0].task, self._jobs[0][0].task):",
        "        while False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "nested-double-overwrite-unreported",
        "a nested region's overwrite_main_grad GEMM into a main_grad its backward overwrote "
        "already is not reported: a use lost without a word",
        "packages/modules/src/groupgrad/modules/_tasks.py",
        "        if twice:",
        "        if False:",
        (f"{MODULES}/test_silent_wrong_gradients.py",),
    ),
    Mutant(
        "hf-no-expert-rows-not-zeroed",
        "a \"no expert\" row rides along in the last expert's GEMMs with its token's values: an "
        "fp16 overflow is NaN, FP8 blocks change",
        "integrations/transformers/src/groupgrad/integrations/transformers/_forward.py",
        "    x_SH = hidden_states[perm_S // top_k].masked_fill((sorted_ids_S == num_experts)[:, None], 0)",
        "    x_SH = hidden_states[perm_S // top_k]",
        (
            "integrations/transformers/tests/test_experts.py",
            "integrations/transformers/tests/test_fp8_experts.py",
        ),
    ),
    Mutant(
        "hf-transposed-compile-refusal-unnamed",
        "transposed experts under a full-graph compile are refused deep in the layers, naming "
        "groupgrad's own weight and advice a model user cannot follow",
        "integrations/transformers/src/groupgrad/integrations/transformers/_forward.py",
        "            _refuse_transposed_under_compile(self, up_name, up, down)\n",
        "            pass\n",
        ("integrations/transformers/tests/test_compile.py",),
    ),
    Mutant(
        "bias-fp32-dy-one-bf16-operand",
        "fp32 dy split after rounding it to bf16: the bias gradient loses dy's low 16 bits",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "dy_TX = dy_TN if whole else _exact_bf16_parts(dy_TN)",
        "dy_TX = dy_TN if whole else _exact_bf16_parts(dy_TN.bfloat16())",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-fp32-split-drops-its-last-part",
        "fp32 dy's exact bf16 split loses its third part: the bias gradient misses dy's last bits",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    parts[:, 2] = rest.sub_(middle)",
        "    parts[:, 2] = 0",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-fp32-split-rounds",
        "fp32 dy's split rounds its first part to bf16: a finite dy near the fp32 maximum "
        "becomes inf in the bias gradient",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "high = torch.where(finite, _top_bf16_bits(x), x)",
        "high = torch.where(finite, x.bfloat16().float(), x)",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-fp32-split-of-inf-is-nan",
        "an infinite fp32 dy split into parts whose sum is NaN: the bias gradient NaN, not inf",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "rest = torch.sub(x, high, out=high).masked_fill_(~finite, 0.0)",
        "rest = torch.sub(x, high, out=high)",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-fp32-split-sums-one-dropped",
        "the bias gradient adds only two of fp32 dy's three part sums",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "    return (high + (middle + low)).to(dtype)",
        "    return (high + middle).to(dtype)",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-grad-by-an-atomic-op",
        "the bias gradient passes through an index_add_ (same values on the CPU; on CUDA its "
        "atomic adds change the bits from run to run)",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "        return db_EX.contiguous().to(dtype)\n",
        "        index = torch.arange(db_EX.shape[0], device=db_EX.device)\n"
        "        return torch.zeros_like(db_EX).index_add_(0, index, db_EX).to(dtype)\n",
        (f"{MODULES}/test_reproducible.py",),
    ),
    Mutant(
        "hf-combine-by-an-atomic-op",
        "the experts' outputs put back in token order by an index_add_ (same values; on CUDA "
        "its atomic adds change the bits from run to run)",
        "integrations/transformers/src/groupgrad/integrations/transformers/_forward.py",
        "    unsorted_SH = torch.empty_like(y_SH).index_copy(0, perm_S, y_SH)",
        "    unsorted_SH = torch.zeros_like(y_SH).index_add_(0, perm_S, y_SH)",
        ("integrations/transformers/tests/test_experts.py",),
    ),
    Mutant(
        "compiled-splits-snapshot-recomputed",
        "the traced splits snapshot a plain clone: inductor's partitioner recomputes it in the "
        "backward from the caller's buffer, refilled by then (wrong gradients, or autograd's "
        "version error)",
        _GROUP,
        "        return _snapshot_op(splits)\n",
        "        return splits.clone()\n",
        (f"{MODULES}/test_compile.py::test_compiled_model_keeps_every_fp32_wgrad_route",),
    ),
    Mutant(
        "bias-fp32-dy-whole-into-the-gemm",
        "fp32 dy handed to the bias GEMM whole: on the GPU's reference path with TF32 allowed "
        "cuBLAS rounds it to 10 bits",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "whole = dy_TN.dtype in (torch.bfloat16, torch.float16)",
        "whole = dy_TN.dtype in (torch.bfloat16, torch.float16, torch.float32)",
        (f"{MODULES}/test_linear.py",),
    ),
    Mutant(
        "bias-fp16-dy-rounded-to-bf16",
        "fp16 dy rounded to bf16 on its way into the bias GEMM: its last 3 bits lost",
        "packages/modules/src/groupgrad/modules/_grads.py",
        "dy_TX = dy_TN if whole else _exact_bf16_parts(dy_TN)",
        "dy_TX = dy_TN.bfloat16() if whole else _exact_bf16_parts(dy_TN)",
        (f"{MODULES}/test_linear.py",),
    ),
)
