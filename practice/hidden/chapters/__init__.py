"""Hidden tests for the graded exercises in notebooks/ (instructor edition only).

One module per chapter (``ch01_the_engine.py`` for ``01_the_engine.ipynb``). Each
``check_*`` function takes the learner's function, runs it inside the real engine, and
returns a list of failure messages (empty means passed); ``ch01_the_engine.check_exercise``
instead runs the chapter's hidden tests of one ``course_lib`` exercise region. The
notebook's hidden-test cell asserts that the list is empty:

    ### BEGIN HIDDEN TESTS
    import os, sys, pathlib, course_lib  # hidden tests: $COURSE_HIDDEN_DIR, else <repo>/practice/hidden
    sys.path.insert(0, os.environ.get("COURSE_HIDDEN_DIR") or str(pathlib.Path(course_lib.__file__).parents[1] / "practice" / "hidden"))
    from chapters.ch01_the_engine import check_predict_cached_tokens
    failures = check_predict_cached_tokens(predict_cached_tokens); assert not failures, "\\n".join(failures)
    ### END HIDDEN TESTS

Returning messages instead of raising keeps this file out of tracebacks, so nbgrader's
feedback shows the learner those few lines and the messages, never the tests' source.
Checks draw fresh random inputs on every run and call the candidate before any reference.
"""
