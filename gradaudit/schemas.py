"""The JSON documents' fields, described once: the report's (``Report.to_dict``, ``scan --json``), the
plan's (``Plan.to_dict``, ``plan --json``) and the fit's (``Fit.to_dict``, ``fit --json``).

``docs/json.md`` and the JSON Schemas in ``docs/schemas/`` are generated from these declarations
(``python docs/generate.py``), and the test suite validates real documents against the schemas, whose
objects admit no field they do not declare: a field added to a document without its description here
fails there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

JSON_SCHEMA = "https://json-schema.org/draft/2020-12/schema"

Type = Union[str, tuple[str, ...]]  # a JSON Schema type, or several ("integer", "null")


@dataclass(frozen=True)
class Field:
    """One field of a JSON object: its type, what it means and, for an object or an array of objects,
    the fields of that object. ``optional``: present only in some documents (the description says when).
    ``open``: an object whose keys are data (bytes by category, a node's scalars), not declared."""

    type: Type
    description: str
    fields: Optional[dict[str, "Field"]] = None
    optional: bool = False
    open: bool = False
    items: Type = "object"  # an array's item type where it is not objects of ``fields``
    extra: dict[str, Any] = field(default_factory=dict)  # further JSON Schema keywords (const, enum)


def _nullable(kind: Type) -> tuple[str, ...]:
    return (kind, "null") if isinstance(kind, str) else (*kind, "null")


INT, STR, BOOL, NUM = "integer", "string", "boolean", "number"
LIST, OBJ = "array", "object"

CONTEXT = {
    "tool": Field(STR, "`\"gradaudit\"`", extra={"const": "gradaudit"}),
    "model": Field(STR, "the model's class name"),
    "device": Field(STR, "the device the model ran on (`cpu`, `cuda`, `meta`)"),
    "target": Field(STR, "the device type the figures stand for: the one it ran on, or for a run on `meta` the "
                         "one whose kernel choices, autocast and allocator it emulated (`cpu` or `cuda`)"),
}

SUMMARY = {
    "saved_bytes": Field(INT, "bytes autograd holds for backward after the forward, each storage once"),
    "reclaimable_bytes": Field(INT, "of those, what dropping every save backward cannot need frees"),
    "reclaimable_with_bitpacking_bytes": Field(INT, "that, with sign-only saves and dropout masks kept as bits"),
    "rewrite_bytes": Field(INT, "what the code changes the rules state would free (fused attention, a clone, a "
                                "detached input)"),
    "reclaimable_with_all_fixes_bytes": Field(INT, "every fix together: what the thresholds compare"),
    "recomputed_bytes": Field(INT, "held by checkpoints instead of the saves they recompute"),
    "offloaded_bytes": Field(INT, "moved off the device by `save_on_cpu`"),
    "kept_on_modules_bytes": Field(INT, "activations the forward stored as module attributes: held by the "
                                        "modules, not autograd"),
    "saved_tensors": Field(INT, "tensors saved"),
    "unknown_tensors": Field(INT, "saves with no verdict (no rule knows their node; `--verify` proves them)"),
    "uncounted_tensors": Field(INT, "sparse or other non-strided saves: size unknown, in no byte figure"),
    "findings": Field(INT, "findings"),
    "waste_findings": Field(INT, "findings of severity `waste`"),
    "parameters_requiring_grad": Field(INT, "parameter tensors that want a gradient"),
    "inputs_requiring_grad": Field(INT, "input tensors that want a gradient"),
}

FINDING = {
    "code": Field(STR, "the rule's code (`GA101`)"),
    "name": Field(STR, "the rule's name, kebab-case (`conv-input-saved-for-frozen-weight`)"),
    "severity": Field(STR, "`waste`, `warning` or `info`", extra={"enum": ["waste", "warning", "info"]}),
    "message": Field(STR, "what was found, in one sentence"),
    "module": Field(STR, "the module path (`\"\"`: the model itself)"),
    "module_class": Field(STR, "its class"),
    "node": Field(STR, "the autograd node (`ConvolutionBackward0`)"),
    "attrs": Field(LIST, "the node's saved attributes concerned", items=STR),
    "source": Field(_nullable(STR), "`file.py:line` of the user's code that made it"),
    "tensors": Field(LIST, "indices into `tensors`", items=INT),
    "bytes": Field(INT, "freed by this fix alone"),
    "bytes_together": Field(INT, "this finding's share when every fix applies (the shares sum to the total)"),
    "fix": Field(STR, "the fix, in one line"),
    "fix_code": Field(STR, "the fix as code"),
    "fix_safe": Field(BOOL, "the fix keeps gradients bit-identical"),
    "proven": Field(BOOL, "the empirical proof (`--verify`) confirmed it"),
    "rewrite": Field(BOOL, "the fix is a code change whose bytes the rule states"),
    "docs": Field(STR, "the command that prints the rule's documentation"),
    "docs_url": Field(STR, "the rule's page: under `$GRADAUDIT_DOCS_URL` where the site is served, else "
                           "`docs/rules/CODE.md` in the source repository"),
}

TENSOR = {
    "index": Field(INT, "its index in `tensors`"),
    "node": Field(STR, "the node that saved it (`ConvolutionBackward0`)"),
    "node_id": Field(INT, "that node's `id` in `nodes`"),
    "attr": Field(STR, "the saved attribute (`input`; `saved_tensors[0]` for custom Functions; `inputs[0]` on "
                       "`CheckpointInputs`)"),
    "shape": Field(LIST, "its shape", items=INT),
    "dtype": Field(STR, "its dtype (`\"float32\"`)"),
    "device": Field(STR, "its device"),
    "nbytes": Field(_nullable(INT), "its whole storage's bytes (`null`: uncounted)"),
    "view_nbytes": Field(INT, "the bytes of the view itself"),
    "storage": Field(_nullable(INT), "the `id` of its storage in `storages`"),
    "storage_kind": Field(STR, "`activation`, `output`, `parameter`, `buffer`, `input`, `module` (an activation "
                               "the forward stored as a module attribute) or `resharded` (an FSDP2 gathered "
                               "weight, freed after the forward: 0 bytes held)"),
    "module": Field(STR, "the module whose forward saved it"),
    "module_class": Field(STR, "its class"),
    "source": Field(_nullable(STR), "`file.py:line` of the user's code that made the save"),
    "managed_by": Field(STR, "`autograd`, `checkpoint`, `offload` or `hooks` (the user's own saved-tensor hooks)"),
    "needed": Field(_nullable(BOOL), "whether backward needs it (`null`: unknown)"),
    "verdict": Field(STR, "`needed`, `not-needed`, `sign-only` or `unknown`"),
    "proven": Field(BOOL, "the verdict comes from the empirical proof"),
    "reason": Field(STR, "why, in words"),
    "rule": Field(_nullable(STR), "the code of the rule that judged it"),
    "bitpackable": Field(BOOL, "backward reads only its sign or two values: one bit per element would do"),
    "unproven": Field(_nullable(STR), "with `--verify`: why the proof could not decide this save (`null`: "
                                      "it did, or no proof ran)"),
    "copy_of": Field(_nullable(STR), "a `torch.compile`d region's save: the parameter it is a copy of (equal "
                                     "values in a storage of its own, another layout say); `null` otherwise"),
}

STORAGE = {
    "id": Field(INT, "its id (`tensors[].storage`)"),
    "nbytes": Field(INT, "its bytes"),
    "kind": Field(STR, "as `tensors[].storage_kind`"),
    "module": Field(STR, "the module it is attributed to"),
    "tensors": Field(LIST, "the saves that hold it (indices into `tensors`)", items=INT),
    "gathered_over": Field(INT, "on all-gathered data only: the number of ranks it was gathered over",
                           optional=True),
}

MODULE = {
    "path": Field(STR, "the module path (`\"\"`: the model)"),
    "module_class": Field(STR, "its class"),
    "own_bytes": Field(INT, "held by saves its own forward made"),
    "total_bytes": Field(INT, "held by saves of it and its submodules"),
    "own_reclaimable_bytes": Field(INT, "of its own, what the fixes free"),
    "total_reclaimable_bytes": Field(INT, "of its and its submodules', what the fixes free"),
}

NODE = {
    "id": Field(INT, "its id"),
    "name": Field(STR, "its type (`AddmmBackward0`)"),
    "module": Field(STR, "the module whose forward made it"),
    "next_ids": Field(LIST, "the nodes its gradients flow to (`null`: that input needs no gradient)",
                      items=("integer", "null")),
    "edge_mask": Field(LIST, "for each input, whether it needs a gradient", items=BOOL),
    "saved": Field(LIST, "its saves (indices into `tensors`)", items=INT),
    "variable": Field(_nullable(STR), "on AccumulateGrad: `param:NAME` or `input:N`"),
    "scalars": Field(OBJ, "non-tensor saved values (batch norm's `training`, `eps`)", open=True),
    "created_here": Field(BOOL, "`false`: the node predates the audited forward and was not inspected"),
    "attention": Field(_nullable(OBJ), "made inside `F.scaled_dot_product_attention`: the kernel it chose and "
                                       "would choose without dropout, the device type it chose for, what a "
                                       "fused kernel would keep, and for `target=\"cuda\"` `passed_over`: each "
                                       "fused backend tried before the chosen one and why it did not take the "
                                       "call", open=True),
}

UNEXPLAINED = {
    "node": Field(STR, "a node type whose held saves no rule understood"),
    "tensors": Field(INT, "how many of its saves"),
    "view_bytes": Field(INT, "their bytes"),
    "attrs": Field(LIST, "their attributes", items=STR),
}

DISAGREEMENT = {
    "tensor": Field(INT, "the save (index into `tensors`)"),
    "node": Field(STR, "its node"),
    "attr": Field(STR, "its attribute"),
    "module": Field(STR, "its module"),
    "static": Field(STR, "the op knowledge's verdict"),
    "proven": Field(STR, "the proof's (the one used)"),
    "what": Field(STR, "what the knowledge claimed that does not hold"),
}

REPORT = {
    "schema_version": Field(INT, "`1`", extra={"const": 1}),
    "tool": CONTEXT["tool"],
    "model": CONTEXT["model"],
    "torch_version": Field(STR, "the torch the audit ran on"),
    "device": CONTEXT["device"],
    "target": CONTEXT["target"],
    "training": Field(BOOL, "the model was in training mode"),
    "verified": Field(BOOL, "the empirical proof ran (`verify=True`, `--verify`)"),
    "select": Field(LIST, "the rule code prefixes selected: findings and every byte figure count these only",
                    items=STR),
    "ignore": Field(LIST, "the rule code prefixes ignored", items=STR),
    "summary": Field(OBJ, "the audit's figures", SUMMARY),
    "findings": Field(LIST, "what backward does not need, one per rule and module call", FINDING),
    "tensors": Field(LIST, "every tensor autograd saved", TENSOR),
    "storages": Field(LIST, "the storages those tensors keep alive, each once", STORAGE),
    "modules": Field(LIST, "per module: what its forward's saves hold", MODULE),
    "nodes": Field(LIST, "the autograd graph's nodes", NODE),
    "unexplained": Field(LIST, "node types whose held saves no rule understood", UNEXPLAINED),
    "disagreements": Field(LIST, "with `verified`: each save where the proof refuted the op knowledge (a "
                                 "gradaudit bug, to report; the proof's verdict is the one used)", DISAGREEMENT),
    "notes": Field(LIST, "caveats about this audit", items=STR),
    "world": Field(OBJ, "only for an audit of one rank of a distributed run (a fake world or a real one)", {
        "size": Field(INT, "the world size"),
        "rank": Field(INT, "this rank"),
        "regathered_bytes": Field(INT, "the storages of the FSDP2 gathered weights the forward saved, padded as "
                                       "FSDP2 gathers them, gathered again for backward"),
    }, optional=True),
    "eager": Field(OBJ, "only with `compare_eager=True` (`scan --compare-eager`) for a compiled model: what the same "
                        "model run eagerly holds", {
        "saved_bytes": Field(INT, "held by eager autograd's saves"),
        "reclaimable_with_bitpacking_bytes": Field(INT, "of those, what eager's fixes free"),
        "modules": Field(LIST, "per module either run holds something in, largest change first", {
            "path": MODULE["path"],
            "module_class": MODULE["module_class"],
            "eager_bytes": Field(INT, "held by the saves its eager forward makes"),
            "compiled_bytes": Field(INT, "held by the compiled regions' saves attributed to it"),
        }),
    }, optional=True),
}

BLOCK = {
    "path": Field(STR, "the candidate's module path"),
    "module_class": Field(STR, "its class"),
    "calls": Field(INT, "its calls in one forward"),
    "flops": Field(INT, "its forward FLOPs, all calls"),
    "kept_flops": Field(INT, "of those, in ops an op-level checkpoint keeps"),
    "seconds": Field(_nullable(NUM), "its measured forward time, all calls (`null` unless `cost` is `\"time\"`)"),
    "internal_bytes": Field(INT, "what its ops' saves hold"),
    "input_bytes": Field(INT, "what a checkpoint of it holds instead"),
    "cached_bytes": Field(_nullable(INT), "what an op-level checkpoint keeps besides (`null`: no such option)"),
}

FRONTIER_POINT = {
    "held_bytes": Field(INT, "held after the forward"),
    "extra_flops": Field(INT, "with `cost` `\"flops\"`: the FLOPs recomputed", optional=True),
    "extra_seconds": Field(NUM, "with `cost` `\"time\"`: the seconds recomputed", optional=True),
}

BASELINE = {
    "name": Field(STR, "`none`, `every block`, `every N blocks` or `N segments`"),
    "checkpointed": Field(LIST, "the module paths it checkpoints", items=STR),
    "held_bytes": Field(INT, "held after the forward"),
    "extra_flops": Field(INT, "FLOPs recomputed"),
    "extra_seconds": Field(_nullable(NUM), "seconds recomputed (`null` unless `cost` is `\"time\"`)"),
    "peak_bytes": Field(_nullable(INT), "its step's measured peak (`null`: not measured)"),
}

PLAN = {
    "schema_version": Field(INT, "`2` (version 2 added `cost`, the `*_seconds` fields, and `extra_compute` "
                                 "and `frontier[]` in the cost's units)", extra={"const": 2}),
    "tool": CONTEXT["tool"],
    "kind": Field(STR, "`\"plan\"`", extra={"const": "plan"}),
    "model": CONTEXT["model"],
    "device": CONTEXT["device"],
    "target": CONTEXT["target"],
    "budget": Field(INT, "the budget in bytes: held after the forward, or the peak with `bound` `\"peak\"`"),
    "fits": Field(BOOL, "the plan keeps within the budget"),
    "held_bytes": Field(INT, "held after the forward under the plan (exact: what an audit counts)"),
    "unplanned_held_bytes": Field(INT, "held after the forward without it"),
    "cost": Field(STR, "what the plan minimises: `\"flops\"` (forward FLOPs, counted) or `\"time\"` (forward "
                       "time, measured on the model's device)", extra={"enum": ["flops", "time"]}),
    "extra_flops": Field(INT, "forward FLOPs the recomputation adds per step (whatever the cost)"),
    "step_flops": Field(INT, "FLOPs of an unplanned step"),
    "extra_seconds": Field(_nullable(NUM), "with `cost` `\"time\"`: measured seconds the recomputation adds per "
                                           "step (`null` otherwise)"),
    "step_seconds": Field(_nullable(NUM), "with `cost` `\"time\"`: seconds of an unplanned step"),
    "extra_compute": Field(NUM, "what the recomputation adds as a share of an unplanned step, in the cost's "
                                "units: `extra_flops / step_flops` or `extra_seconds / step_seconds`"),
    "peak_bytes": Field(_nullable(INT), "the peak of one step with the plan, measured on the model's device "
                                        "(`null`: not measured)"),
    "unplanned_peak_bytes": Field(_nullable(INT), "and without it"),
    "replaces": Field(LIST, "the modules the model checkpoints itself (the plan's figures are without that)",
                      items=STR),
    "current_held_bytes": Field(_nullable(INT), "what it holds with the model's own checkpoints"),
    "trim": Field(_nullable(OBJ), "`null`: the figures are without `gradaudit.trim`; `{\"bitpack\": true, "
                                  "\"masks\": \"bits\"}` (or `false`, `\"bytes\"`): every byte figure is with "
                                  "`trim(model, bitpack=..., masks=...)` installed, as `Plan.apply` installs it (`--trim`)",
                  {"bitpack": Field(BOOL, "trim's bitpack"),
                   "masks": Field(STR, "trim's masks: what a bit-packable save becomes, `\"bits\"` or `\"bytes\"` "
                                       "(one bool per element)", extra={"enum": ["bits", "bytes"]})}),
    "bound": Field(STR, "what `budget` bounds: `\"held\"` (held after the forward) or `\"peak\"` (the measured "
                        "peak of a step)", extra={"enum": ["held", "peak"]}),
    "checkpointed": Field(LIST, "module paths the plan checkpoints, in forward order", items=STR),
    "selective": Field(LIST, "those of them checkpointed op by op (the outputs of their matrix products, "
                             "convolutions, attention and batch norm kept)", items=STR),
    "optimal": Field(BOOL, "`false` when some storage had to be charged as always held (a cheaper plan may "
                           "exist; `notes` says)"),
    "blocks": Field(LIST, "every candidate", BLOCK),
    "frontier": Field(LIST, "every plan no other beats on both held bytes and cost, cheapest first",
                      FRONTIER_POINT),
    "baselines": Field(LIST, "what users otherwise checkpoint, measured the same way", BASELINE),
    "notes": Field(LIST, "caveats about this plan", items=STR),
}

BREAKDOWN = Field(OBJ, "bytes by category: `parameters`, `buffers`, `inputs`, `optimizer_state`, `workspaces` "
                       "(cuBLAS's and cuBLASLt's on a CUDA target; 0 on the CPU), `gradient_buckets` (only where a "
                       "`DistributedDataParallel` holds some), `pipeline_buffers` (only for a pipeline stage: its "
                       "receive buffers), `gradients`, `activations`, `temporaries`, and on a CUDA target "
                       "`unsplit_blocks` (what the allocator hands out beyond the requests)", open=True)

NAMED_BYTES = {"name": Field(STR, "what it is"), "bytes": Field(INT, "its bytes")}

ATTRIBUTION = {
    "largest": Field(LIST, "the largest storages the step made alive at the peak", {
        "bytes": Field(INT, "its bytes, as the target's allocator counts them"),
        "category": Field(STR, "its category (as in `breakdown`)"),
        "op": Field(STR, "the op that made it"),
        "module": Field(STR, "the module whose forward was running (in backward: whose forward made the node)"),
        "source": Field(_nullable(STR), "the user's line that called it"),
        "phase": Field(STR, "`forward`, `backward` or `optimizer`"),
    }),
    "activations_by_module": Field(LIST, "activations summed by module, largest first", NAMED_BYTES),
    "activations_by_block": Field(LIST, "activations summed by block (`model.layers.3`)", NAMED_BYTES),
    "repeated_blocks": Field(LIST, "per container of numbered blocks (`model.layers`)", {
        "name": Field(STR, "the container"),
        "blocks": Field(INT, "how many of its blocks hold activations"),
        "bytes": Field(INT, "their bytes in all"),
        "largest_block": Field(INT, "the most one block holds"),
    }),
    "loss_bytes": Field(INT, "the loss's storages alive then (its log-softmax, backward's gradients of it)"),
    "temporaries_by_op": Field(LIST, "temporaries summed by op, module and phase", NAMED_BYTES),
}

REMEDY = {
    "change": Field(STR, "the change, in words"),
    "micro_batch": Field(_nullable(INT), "the micro-batch's rows (`null`: the batch as given)"),
    "accumulation": Field(INT, "micro-batches per optimizer step"),
    "trim": Field(BOOL, "`gradaudit.trim` is part of it"),
    "bitpack": Field(_nullable(BOOL), "trim's bitpack (`null` without trim)"),
    "masks": Field(_nullable(STR), "trim's masks, `\"bits\"` or `\"bytes\"` (`null` without trim)"),
    "checkpointed": Field(LIST, "the blocks it checkpoints", items=STR),
    "selective": Field(LIST, "those checkpointed op by op", items=STR),
    "extra_compute": Field(NUM, "recompute as a share of a step's FLOPs"),
    "extra_flops": Field(INT, "FLOPs recomputed"),
    "peak_bytes": Field(INT, "the step's peak with it"),
    "headroom": Field(INT, "the headroom with it"),
    "breakdown": BREAKDOWN,
    "schedule": Field(STR, "a pipeline stage's only: the schedule's class", optional=True),
    "micro_batches": Field(INT, "a pipeline stage's only: the micro-batch count", optional=True),
}

FIT = {
    "schema_version": Field(INT, "`1`", extra={"const": 1}),
    "tool": CONTEXT["tool"],
    "kind": Field(STR, "`\"fit\"`", extra={"const": "fit"}),
    "model": CONTEXT["model"],
    "device": CONTEXT["device"],
    "target": CONTEXT["target"],
    "optimizer": Field(STR, "the optimizer's name"),
    "accumulation": Field(INT, "the micro-batches per optimizer step"),
    "memory": Field(INT, "the memory given, in bytes"),
    "fits": Field(BOOL, "`peak_bytes` and `headroom` are within it"),
    "peak_bytes": Field(INT, "the peak of one steady-state step as the target's allocator counts it"),
    "peak_phase": Field(STR, "where it falls: `forward`, `backward`, `optimizer`; with accumulation `backward "
                             "(micro-batch 1)`, `backward (micro-batches 2-4)`..."),
    "reserved_bytes": Field(_nullable(INT), "on CUDA, an estimate of what the caching allocator reserves (its "
                                            "rules replayed over two steps); `null` on the CPU"),
    "headroom": Field(INT, "what the device needs beside the peak (as given, or on CUDA by default "
                           "`reserved_bytes - peak_bytes`; 0 on the CPU)"),
    "margin": Field(INT, "the memory left beside both (negative: by how much it does not fit)"),
    "allocator": Field(STR, "what `peak_bytes` counts, in words"),
    "breakdown": BREAKDOWN,
    "attribution": Field(OBJ, "what made the bytes at the peak, ten of each", ATTRIBUTION),
    "trained_parameters": Field(INT, "parameter tensors that get a gradient and optimizer state"),
    "remedy": Field(_nullable(OBJ), "`null`, or the cheapest change whose step fits", REMEDY),
    "levers": Field(LIST, "where the step does not fit, changes named but not applied", {
        "name": Field(STR, "the lever"),
        "saves_bytes": Field(INT, "fewer bytes at the peak, an estimate"),
        "assumes": Field(STR, "what the estimate assumes"),
        "how": Field(STR, "how to pull it"),
    }),
    "remedy_searched": Field(BOOL, "a remedy was searched (only when the step does not fit)"),
    "alternatives": Field(LIST, "what users otherwise try, measured", {
        "name": Field(STR, "what"),
        "peak_bytes": Field(_nullable(INT), "the step's peak under it (`null`: not applicable)"),
        "extra_compute": Field(_nullable(NUM), "its recompute share"),
        "fits": Field(BOOL, "it fits"),
    }),
    "timeline": Field(LIST, "bytes by category through the step, each stretch's worst moment (<= 400 points): "
                            "`sample`, `phase` and a field per category, as in `breakdown`",
                      {"sample": Field(INT, "the moment's number"), "phase": Field(STR, "its phase")}, open=True),
    "largest": Field(_nullable(OBJ), "`fit --largest` only: `{\"batch\": N}`, `{\"seq\": N}` or (a pipeline "
                                     "stage) `{\"micro-batches\": N}`; `null` where the memory does not bound it",
                     open=True, optional=True),
    "notes": Field(LIST, "caveats about this fit", items=STR),
}

DOCUMENTS = {"report": REPORT, "plan": PLAN, "fit": FIT}


def _property(spec: Field) -> dict[str, Any]:
    kind = list(spec.type) if isinstance(spec.type, tuple) else spec.type
    out: dict[str, Any] = {"type": kind, "description": spec.description, **spec.extra}
    if "array" in spec.type:
        out["items"] = (_object(spec.fields, spec.open) if spec.fields is not None
                        else {"type": list(spec.items) if isinstance(spec.items, tuple) else spec.items})
    elif "object" in spec.type and spec.fields is not None:
        out.update({key: value for key, value in _object(spec.fields, spec.open).items() if key != "type"})
    return out


def _object(fields: dict[str, Field], open_: bool = False) -> dict[str, Any]:
    return {"type": "object", "properties": {name: _property(spec) for name, spec in fields.items()},
            "required": [name for name, spec in fields.items() if not spec.optional],
            "additionalProperties": open_}


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the ``kind`` document: ``"report"``, ``"plan"`` or ``"fit"``."""
    if kind not in DOCUMENTS:
        raise ValueError(f"unknown document {kind!r}: one of {', '.join(DOCUMENTS)}")
    title = {"report": "gradaudit report", "plan": "gradaudit plan", "fit": "gradaudit fit"}[kind]
    return {"$schema": JSON_SCHEMA, "title": title, **_object(DOCUMENTS[kind])}
