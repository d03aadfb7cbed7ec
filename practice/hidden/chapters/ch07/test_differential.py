"""Chapter 07, differential: the learner's error mapping, route rules, flush retry and
trainer's flow beside the reference's, on the same random (seeded, derandomized) inputs, with
the edge cases each docstring names given explicitly.

Compared: the status, code and retryable flag as they go on the wire (503 and "503", true
and 1 differ), what each message must name (never its wording, which the contract leaves
free), that nothing was changed, the traceback logged for an internal error, the constant
time comparison of a key; for the client, every request it sends (method, path, body; a
tensor bucket by its contents) and every sleep, in order, against a scripted HTTP server on
127.0.0.1 that answers each endpoint with success, an error in the one error shape, a page
that is not JSON, or a dropped connection; what it returned or raised. The flow's phase
seconds are timings: only their types, signs and sum are compared (their values and units
are checked by ``test_hidden.py``'s controlled clock). See ``scenarios_ch07.py`` (run in
both editions) and ``shared/twin.py``.
"""
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import twin
from engine_ops import DIFFERENTIAL


def explain(n, title):
    return f"see Exercise {n} of chapter 07 ({title}), notebooks/07_the_serving_protocol.ipynb"


def same(reference, scenario, call, title_n, title, **kw):
    mine = twin.run_here(f"scenarios_ch07:{scenario}", **kw)
    theirs = reference.run(f"scenarios_ch07:{scenario}", **kw)
    twin.compare_results(call, mine, theirs, explain(title_n, title))


# ---- ch07.route_rules -----------------------------------------------------------------------

WEIGHT = ["/pause_generation", "/continue_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
          "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
          "/update_weight_version", "/register_weight_buffers", "/update_weights_from_registered",
          "/unregister_weight_buffers"]
OTHER = ["/health", "/generate", "/flush_cache", "/get_weight_version", "/get_weights_by_name",
         # near misses: not the open route, not weight routes (exact paths only)
         "/health/", "/healthz", "/pause_generation/now", "/update_weights", "/"]
KEY = "3f9a0c1d7e5b2a64"


def token(kind, key):
    """A presented token of ``kind`` for server key ``key`` (None: any key)."""
    key = key or KEY
    return {"right": key, "prefix": key[:-1], "longer": key + "0", "upper": key.upper() + "X",
            "other": "0" * len(key), "empty": "", "spaces": "   "}[kind]


TOKENS = ["right", "right", "right", "prefix", "longer", "upper", "other", "empty", "spaces"]
auth_forms = st.one_of(
    st.none(),
    st.tuples(st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]), st.sampled_from([" ", "  "]),
              st.sampled_from(TOKENS), st.sampled_from(["", " ", "  "])),
    st.tuples(st.sampled_from(["Basic", "Token"]), st.just(" "), st.sampled_from(TOKENS), st.just("")),
    st.just(("Bearer", "", "empty", "")))
xkey_forms = st.one_of(st.none(), st.tuples(st.sampled_from(["", " "]), st.sampled_from(TOKENS),
                                            st.sampled_from(["", " "])))


@st.composite
def rule_cases(draw):
    key = draw(st.one_of(st.none(), st.just(KEY), st.text("0123456789abcdef", min_size=4, max_size=32)))
    auth, xkey = draw(auth_forms), draw(xkey_forms)
    headers = []
    if auth is not None:
        scheme, sep, kind, trail = auth
        headers.append(["Authorization", f"{scheme}{sep}{token(kind, key)}{trail}"])
    if xkey is not None:
        lead, kind, trail = xkey
        headers.append(["X-API-Key", f"{lead}{token(kind, key)}{trail}"])
    if draw(st.booleans()):
        headers.append(["Content-Type", "application/json"])
    headers = draw(st.permutations(headers))
    return dict(api_key=key, allow_weight_update=draw(st.booleans()),
                path=draw(st.sampled_from(WEIGHT + OTHER)), headers=list(headers))


def rule(key, allow, path, *headers):
    return dict(api_key=key, allow_weight_update=allow, path=path, headers=[list(h) for h in headers])


@pytest.mark.exercise("ch07.route_rules")
@DIFFERENTIAL
@given(case=rule_cases())
@example(case=rule(KEY, True, "/generate"))                                         # no key: 401
@example(case=rule(KEY, True, "/generate", ("Authorization", "Bearer")))            # Bearer, no token: 401
@example(case=rule(KEY, True, "/generate", ("Authorization", "Bearer   ")))
@example(case=rule(KEY, True, "/generate", ("Authorization", f"Basic {KEY}")))     # not Bearer, no X-API-Key
@example(case=rule(KEY, True, "/generate", ("X-API-Key", "  ")))                    # an empty key: 401
@example(case=rule(KEY, True, "/generate", ("Authorization", f"bEaReR  {KEY} ")))  # any case, stripped
@example(case=rule(KEY, True, "/generate", ("X-API-Key", f" {KEY} ")))              # the other header, stripped
@example(case=rule(KEY, True, "/generate", ("Authorization", "Bearer 0000"), ("X-API-Key", KEY)))  # Bearer wins: 403
@example(case=rule(KEY, True, "/generate", ("Authorization", f"Basic {KEY}x"), ("X-API-Key", KEY)))  # falls back
@example(case=rule(KEY, True, "/generate", ("Authorization", "Bearer  "), ("X-API-Key", KEY)))
@example(case=rule(KEY, True, "/generate", ("X-API-Key", KEY[:-1])))                # a prefix of the key: 403
@example(case=rule(KEY, True, "/generate", ("X-API-Key", KEY + "0")))
@example(case=rule(KEY, False, "/health", ("X-API-Key", "wrong")))                  # /health is open
@example(case=rule(KEY, False, "/health/"))                                          # ... that path only
@example(case=rule(None, True, "/generate", ("Authorization", "Bearer anything")))  # no server key: open
@example(case=rule(None, False, "/update_weights_from_tensor"))                     # switch off: 403 route_disabled
@example(case=rule(KEY, False, "/pause_generation"))                                 # who you are first: 401
@example(case=rule(KEY, False, "/pause_generation", ("X-API-Key", "0000")))         # ... wrong key: 403 forbidden
@example(case=rule(KEY, False, "/pause_generation", ("Authorization", f"Bearer {KEY}")))  # then the switch
@example(case=rule(KEY, False, "/flush_cache", ("X-API-Key", KEY)))                  # not a weight route
@example(case=rule(None, False, "/pause_generation/now"))                            # exact paths, no prefixes
@example(case=rule(None, True, "/update_weight_version"))
def test_route_rules_matches_the_reference(reference, case):
    same(reference, "route_rules",
         f"route_rules({case['path']!r}, headers {case['headers']}) on a server with key {case['api_key']!r}, "
         f"allow_weight_update={case['allow_weight_update']}", 1, "The route rules", **case)


# ---- ch07.error_status ----------------------------------------------------------------------

DOCUMENTED = ["EnginePausedError", "EngineBusyError", "UnsafePickleError", "AddressMovedError", "TimeoutError",
              "ValueError", "RuntimeError"]
OTHERS = ["UpdateError", "CheckpointError", "BucketError", "RegistrationError", "KeyError", "OSError",
          "ZeroDivisionError", "AssertionError", "ConnectionError", "Exception"]
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=24)
reasons = st.one_of(st.none(), st.text("abcdefghij NaN:0123456789", min_size=1, max_size=30))
api_errors = st.tuples(st.integers(400, 599), st.sampled_from(["teapot", "paused", "internal", "x"]), st.booleans())


@st.composite
def status_cases(draw):
    kind = draw(st.sampled_from(["one", "one", "mixed", "api"]))
    api = list(draw(api_errors)) if kind == "api" else None
    if kind == "mixed":  # a class of two documented kinds: the first match in the listed order wins
        bases = draw(st.lists(st.sampled_from(DOCUMENTED), min_size=2, max_size=2, unique=True))
    else:
        bases = [draw(st.sampled_from(DOCUMENTED + OTHERS))]
    return dict(bases=bases, words=draw(words), unhealthy=draw(reasons), api_error=api)


def status(bases, unhealthy=None, api_error=None, words="layer 3: weight moved"):
    return dict(bases=bases, words=words, unhealthy=unhealthy, api_error=api_error)


SICK = "NaN logits in layer 2"


@pytest.mark.exercise("ch07.error_status")
@DIFFERENTIAL
@given(case=status_cases())
# Every documented kind, on a healthy engine and an unhealthy one (unhealthy matters only for
# "anything else"); ValueError's own subclasses; a class of two kinds (first match wins).
@example(case=status(["EnginePausedError"]))
@example(case=status(["EnginePausedError"], SICK))
@example(case=status(["EngineBusyError"], SICK))
@example(case=status(["UnsafePickleError"]))                     # a ValueError, but its own code
@example(case=status(["UnsafePickleError"], SICK))
@example(case=status(["AddressMovedError"], SICK))
@example(case=status(["TimeoutError"], SICK))
@example(case=status(["ValueError"], SICK))
@example(case=status(["UpdateError"]))
@example(case=status(["CheckpointError"], SICK))
@example(case=status(["BucketError"]))
@example(case=status(["RuntimeError"], SICK))
@example(case=status(["RuntimeError"]))                          # internal, logged with its traceback
@example(case=status(["KeyError"], words="model.layers.0.weight"))
@example(case=status(["OSError"], SICK))
@example(case=status(["Exception"], words=""))
@example(case=status([], SICK, api_error=[418, "teapot", True]))  # an ApiError: itself, unchanged
@example(case=status([], None, api_error=[503, "paused", False]))
@example(case=status(["EngineBusyError", "ValueError"], SICK))
@example(case=status(["EnginePausedError", "EngineBusyError"]))
@example(case=status(["AddressMovedError", "TimeoutError"]))
@example(case=status(["TimeoutError", "ValueError"]))
@example(case=status(["EngineBusyError", "UnsafePickleError"]))
def test_error_status_matches_the_reference(reference, case):
    what = (f"ApiError{tuple(case['api_error'])}" if case["api_error"] else
            "+".join(case["bases"]) + f"({case['words']!r})")
    same(reference, "error_status", f"from_engine_exception({what}, engine with unhealthy={case['unhealthy']!r})",
         2, "Engine errors as statuses", **case)


# ---- ch07.flush_retry -----------------------------------------------------------------------

BUSY = ["error", 400, "requests_in_flight", True]
PAUSED = ["error", 503, "paused", True]
TIMEOUT = ["error", 504, "timeout", True]
FORBIDDEN = ["error", 403, "forbidden", False]
BUSY_FOR_GOOD = ["error", 400, "requests_in_flight", False]  # the busy code, but not retryable
INTERNAL = ["error", 500, "internal", False]
PAGE = ["text", 502]                                          # not the error shape: not retryable
DROP = "drop"                                                 # the connection breaks: not an EngineError
RETRYABLE = [BUSY, BUSY, BUSY, PAUSED, TIMEOUT]
FINAL = [FORBIDDEN, BUSY_FOR_GOOD, INTERNAL, PAGE, DROP, "ok"]
replies = st.one_of(st.sampled_from(RETRYABLE), st.sampled_from(RETRYABLE), st.sampled_from(FINAL))
intervals = st.sampled_from([0.0, 0.001, 0.25, 1.0, 2.5, 60.0])


@pytest.mark.exercise("ch07.flush_retry")
@DIFFERENTIAL
@given(script=st.lists(replies, max_size=8), interval_s=intervals, tries=st.integers(1, 6))
@example(script=[], interval_s=1.0, tries=1)                          # the first call succeeds
@example(script=[BUSY, PAUSED, BUSY], interval_s=0.25, tries=4)       # succeeds on the last try
@example(script=[BUSY, BUSY, BUSY], interval_s=1.0, tries=3)          # gives up: the last refusal, no last sleep
@example(script=[BUSY], interval_s=2.5, tries=1)
@example(script=[PAUSED, TIMEOUT, "ok"], interval_s=60.0, tries=5)    # retryable by the flag, whatever the code
@example(script=[BUSY, FORBIDDEN], interval_s=1.0, tries=6)           # not retryable: raised at once
@example(script=[BUSY_FOR_GOOD], interval_s=1.0, tries=6)
@example(script=[BUSY, PAGE], interval_s=1.0, tries=6)
@example(script=[BUSY, DROP], interval_s=1.0, tries=6)                # a broken connection is not retried
@example(script=[], interval_s=1.0, tries=0)                          # tries < 1: ValueError, no call
@example(script=[BUSY], interval_s=1.0, tries=-2)
def test_flush_retry_matches_the_reference(reference, script, interval_s, tries):
    same(reference, "flush_retry",
         f"flush_until_done(interval_s={interval_s}, tries={tries}) against a server whose /flush_cache answers "
         f"{script} in turn, then 200", 3, "Flush with retries", script=script, interval_s=interval_s, tries=tries)


# ---- ch07.client_flow -----------------------------------------------------------------------

REFUSED = ["error", 400, "bad_request", False]
CONFLICT = ["error", 409, "conflict", False]
flush_replies = st.lists(st.one_of(st.just("ok"), st.just("ok"), st.sampled_from(RETRYABLE),
                                   st.sampled_from([FORBIDDEN, INTERNAL, DROP])), max_size=7)
update_replies = st.lists(st.one_of(st.just("ok"), st.just("ok"), st.just("ok"),
                                    st.sampled_from([REFUSED, CONFLICT, PAGE, DROP])), max_size=5)
once = st.one_of(st.just([]), st.just([]), st.just([]), st.lists(st.sampled_from([CONFLICT, INTERNAL, PAGE, DROP]),
                                                                  min_size=1, max_size=1))


@st.composite
def flow_cases(draw):
    script = {"pause_generation": draw(once), "flush_cache": draw(flush_replies),
              "update_weights_from_tensor": draw(update_replies), "update_weights_from_disk": draw(once)}
    return dict(source=draw(st.sampled_from(["tensors", "tensors", "tensors", "disk", "disk", "both", "neither"])),
                seed=draw(st.integers(0, 10_000)), count=draw(st.integers(1, 6)),
                bucket_bytes=draw(st.sampled_from([64, 256, 1024, 1 << 20])),
                weight_version=draw(st.one_of(st.none(), st.integers(0, 99).map(lambda i: f"step-{i}"),
                                              st.integers(0, 99))),
                pause_mode=draw(st.sampled_from([None, "abort", "wait", "retract", "in_place"])),
                flush_interval_s=draw(st.sampled_from([0.0, 0.5, 1.0])), flush_tries=draw(st.integers(1, 4)),
                script=script, aborted=draw(st.integers(0, 5)), disk_bytes=draw(st.integers(0, 10**6)),
                as_list=draw(st.booleans()))


def flow(source="tensors", script=None, count=4, bucket_bytes=256, flush_tries=3, **kw):
    base = dict(source=source, seed=7, count=count, bucket_bytes=bucket_bytes, weight_version="step-1",
                pause_mode=None, flush_interval_s=1.0, flush_tries=flush_tries, script=script or {}, aborted=2,
                disk_bytes=4096, as_list=False)
    return dict(base, **kw)


@pytest.mark.exercise("ch07.client_flow")
@DIFFERENTIAL
@given(case=flow_cases())
@example(case=flow())                                                             # every call succeeds
@example(case=flow(pause_mode="wait", script={"flush_cache": [BUSY, BUSY]}))      # the first flush retried
@example(case=flow("disk", pause_mode="retract"))
@example(case=flow("both"))                                                       # ValueError before any call
@example(case=flow("neither"))
@example(case=flow(script={"pause_generation": [CONFLICT]}))                      # the pause itself refused
@example(case=flow(script={"pause_generation": [DROP]}))
@example(case=flow(script={"flush_cache": [BUSY, BUSY, BUSY]}))                   # the first flush gives up
@example(case=flow(script={"flush_cache": [FORBIDDEN]}))
@example(case=flow(script={"flush_cache": [DROP]}))                               # not an EngineError
@example(case=flow("disk", script={"update_weights_from_disk": [REFUSED]}))      # nothing changed: continue
@example(case=flow("disk", script={"update_weights_from_disk": [DROP]}))
@example(case=flow(script={"update_weights_from_tensor": [REFUSED]}))            # the first bucket refused
@example(case=flow(script={"update_weights_from_tensor": ["ok", REFUSED]}))      # a later one: stay paused
@example(case=flow(count=1, bucket_bytes=1 << 20, script={"update_weights_from_tensor": ["ok", CONFLICT]}))
@example(case=flow(script={"update_weights_from_tensor": ["ok", DROP]}))
@example(case=flow(script={"flush_cache": ["ok", FORBIDDEN]}))                    # the last flush refused
@example(case=flow(script={"flush_cache": ["ok", BUSY, BUSY, BUSY]}))             # ... or gives up
@example(case=flow("disk", script={"flush_cache": ["ok", INTERNAL]}))
@example(case=flow(as_list=True, weight_version=None, pause_mode="abort"))
def test_client_flow_matches_the_reference(reference, case):
    shown = {k: v for k, v in case.items() if k != "script"}
    same(reference, "client_flow",
         f"sync_weights from {case['source']} ({shown}) against a server answering {case['script']} "
         f"(each endpoint in turn, then 200)", 4, "The trainer's flow", **case)
