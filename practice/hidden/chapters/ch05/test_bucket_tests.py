"""Hidden cases of chapter 05's test-writing part (ch05.bucket_tests): the learner's tests of
a bucket validator pass on the reference ``validate`` and fail on each wrong validator below
(suites.py says how the share is scored). Each wrong validator is the same plausible design
with one promise of ``bucket.validate``'s contract broken; the learner has seen two others
(the public cases), not these.
"""
import pytest
import torch

from course_lib.weights.transports import bucket, bucket_checks
from course_lib.weights.transports.bucket import BucketError
from suites import as_function, reference_body, run_tests

TESTS = pytest.mark.exercise("ch05.bucket_tests")

# What each wrong validator gets wrong (the key selects the one change in `wrong_validator`).
BUGS = {
    "end_before_n": "refuses a slot that ends exactly at the buffer's end (end < n, not end <= n)",
    "no_lower_bound": "never checks that a start offset is not negative",
    "no_upper_bound": "never checks a slot's end against the buffer",
    "names_twice": "lets one name appear twice",
    "no_shape_check": "never compares numel with the shape's product",
    "no_alignment": "accepts a start offset that is not a multiple of the dtype's size",
    "align16": "asks every start in the byte layout to be 16-byte aligned (the contract asks for the dtype's size)",
    "bytes_everywhere": "measures every slot in bytes, SGLang's element layout too",
    "no_field_types": "never checks the fields' types (bool sizes, float offsets, negative sizes pass)",
    "value_error": "refuses with ValueError rather than BucketError",
    "unnamed": "refuses without naming the entry",
    "first_only": "checks the first entry and trusts the rest",
    "return_after_bytes": "returns, where it meant to go on to the next entry, after a uint8 entry of a byte layout",
    "any_shape_buffer": "accepts a buffer of any number of dimensions",
    "any_device": "accepts a buffer on any device",
    "any_iterable": "accepts metadata of any iterable type (and consumes a generator)",
    "refuses_empty": "refuses a bucket with no entries",
    "scrubs_gaps": "zeroes the padding between slots of a byte-layout bucket (it writes the buffer)",
}


def wrong_validator(bug: str):
    """A validator written from the contract, with the one change that ``bug`` names."""
    def validate(flat, metadata):
        if bug != "any_shape_buffer" and (not isinstance(flat, torch.Tensor) or flat.dim() != 1):
            raise BucketError("the buffer must be a 1-D tensor")
        if bug != "any_device" and flat.device.type not in ("cpu", "cuda"):
            raise BucketError(f"the buffer is on {flat.device.type}")
        if bug == "any_iterable":
            metadata = list(metadata)
        elif not isinstance(metadata, (list, tuple)):
            raise BucketError("metadata must be a list or a tuple")
        if bug == "refuses_empty" and not metadata:
            raise BucketError("a bucket with no entries")
        n, byte_layout, seen = flat.numel(), flat.dtype == torch.uint8, set()
        error = ValueError if bug == "value_error" else BucketError
        for m in metadata[:1] if bug == "first_only" else metadata:
            if bug != "no_field_types":
                bucket._check_fields(m)
            who = "an entry" if bug == "unnamed" else m.name
            if m.name in seen and bug != "names_twice":
                raise error(f"{who} appears twice")
            seen.add(m.name)
            if torch.Size([int(d) for d in m.shape]).numel() != m.numel and bug != "no_shape_check":
                raise error(f"{who}: numel {m.numel} disagrees with the shape")
            low = bug == "no_lower_bound" or m.start_idx >= 0
            high = bug == "no_upper_bound" or (m.end_idx < n if bug == "end_before_n" else m.end_idx <= n)
            if not (low and high and m.start_idx <= m.end_idx):
                raise error(f"{who}: slot [{m.start_idx}, {m.end_idx}) outside a buffer of {n}")
            in_bytes = (byte_layout and m.dtype != torch.uint8) or bug == "bytes_everywhere"
            if m.end_idx - m.start_idx != m.numel * (m.dtype.itemsize if in_bytes else 1):
                raise error(f"{who}: the slot's length disagrees with numel")
            if bug == "return_after_bytes" and byte_layout and m.dtype == torch.uint8:
                return  # a byte needs no alignment check (meant: go on to the next entry)
            step = 16 if bug == "align16" else m.dtype.itemsize
            if byte_layout and bug != "no_alignment" and m.start_idx % step:
                raise error(f"{who}: start {m.start_idx} is not aligned")
        if bug == "scrubs_gaps" and byte_layout:
            ends = sorted((m.start_idx, m.end_idx) for m in metadata)
            for (_, end), (start, _) in zip(ends, ends[1:] + [(n, n)]):
                flat[end:start] = 0
    return validate


@TESTS
def test_bucket_tests__pass_on_the_reference_validator(reference_root):
    body = reference_body(reference_root, "weights/transports/bucket.py", "ch05.validate_bucket")
    failed = run_tests(bucket_checks.check_bucket_validator, as_function(bucket.validate, body))
    assert failed is None, (f"your check_bucket_validator fails on the reference validator, which keeps the whole "
                            f"contract: {failed}; a test must pass on every right validator")


@TESTS
def test_bucket_tests__the_wrong_validators_differ_from_a_right_one_only_where_they_say():
    # Without a bug the same code is a right validator: each wrong one breaks one promise only.
    failed = run_tests(bucket_checks.check_bucket_validator, wrong_validator("none"))
    assert failed is None, f"the judge's own validator without a bug fails your tests: {failed}"


# Neutral case names: a learner's report says how many wrong validators passed, not which bug each has.
@TESTS
@pytest.mark.parametrize("bug", list(BUGS), ids=[f"hidden validator {i + 1}" for i in range(len(BUGS))])
def test_bucket_tests_catches_a_wrong_validator(bug):
    failed = run_tests(bucket_checks.check_bucket_validator, wrong_validator(bug))
    assert failed is not None, ("your check_bucket_validator passes on a validator that breaks a promise of "
                                "bucket.validate's contract: which promise does none of your checks test?")
