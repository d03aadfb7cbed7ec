# Rolls back by pointing each tensor at its host copy instead of copying into it.
if min_quality is not None and quality is None:
    raise ValueError("min_quality needs a quality function")
expected = greedy_outputs(reference, prompts, max_new_tokens)  # before anything changes
result = {"decision": None, "reasons": [], "agreement": None, "quality": None, "update": None,
          "rollback": None, "comparison": None}
engine.pause_generation(pause_mode)
try:
    result["update"] = engine.update_weights_from_disk(new_path, weight_version=weight_version,
                                                       keep_snapshot=True, partial=partial)
except UpdateError as exc:  # validated before any write, or put back: the old weights serve
    result.update(decision="rejected", reasons=[f"update refused: {exc}"])
    return result
finally:  # a paused engine serves nobody: continue on every way out, errors included
    engine.continue_generation()

got = greedy_outputs(engine, prompts, max_new_tokens)
comparison = compare(expected, got)
result["comparison"] = comparison
result["agreement"] = float(comparison["agreement"])
if result["agreement"] < min_agreement:
    result["reasons"].append(f"agreement {result['agreement']:.2f} is below {min_agreement:.2f}")
if quality is not None:
    result["quality"] = float(quality(engine))
    if result["quality"] < min_quality:
        result["reasons"].append(f"quality {result['quality']:.4f} is below {min_quality:.4f}")
if result["reasons"]:
    from course_lib.weights.commit.audit import kernel_tensors
    live = kernel_tensors(engine.model)
    for name, host in engine.snapshot.tensors.items():
        live[name].data = host.clone()
    result["rollback"] = engine.update_weight_version(engine.snapshot.weight_version)
    result["decision"] = "rolled_back"
else:
    result["decision"] = "promoted"
return result
