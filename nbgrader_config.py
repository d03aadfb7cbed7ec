"""nbgrader settings for the instructor edition (this repository).

The chapter notebooks in notebooks/ are the source of one nbgrader assignment named
"notebooks". Run nbgrader from the repository root: it keeps its gradebook, the
submissions, the autograded copies and the feedback under grading/, and writes the
student notebooks to student/notebooks/ (``python scripts/release.py`` builds the whole
student edition, practice problems included).

    nbgrader generate_assignment notebooks --force     # or: python scripts/release.py
    # put each submission in grading/submitted/<student>/notebooks/
    nbgrader autograde notebooks
    nbgrader generate_feedback notebooks               # grading/feedback/<student>/notebooks/*.html

Hidden tests live in practice/hidden/chapters/; the hidden-test cells find them through
$COURSE_HIDDEN_DIR, else through the repository that holds the installed course_lib.
"""
import os

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)
grading = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grading")
c.CourseDirectory.root = grading
c.CourseDirectory.source_directory = ".."                      # so the assignment "notebooks" is notebooks/
c.CourseDirectory.release_directory = os.path.join("..", "student")
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(grading, "gradebook.db")
c.Execute.kernel_name = "python3"
c.Execute.timeout = 300  # seconds per cell; a chapter runs in well under a minute on 2 CPU cores
