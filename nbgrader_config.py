"""nbgrader settings for the instructor edition (this repository).

The chapter notebooks in notebooks/ are the source of one nbgrader assignment named
"notebooks". Run nbgrader from the repository root: it keeps its gradebook, the
submissions, the autograded copies and the feedback under grading/, and writes the
student notebooks to student/notebooks/ (``python scripts/release.py`` builds the whole
student edition, practice problems included).

    nbgrader generate_assignment notebooks --force     # or: python scripts/release.py
    # put each learner's hand-in in grading/submitted/<student>/:
    #   grading/submitted/<student>/notebooks/*.ipynb    their notebooks (nbgrader's assignment)
    #   grading/submitted/<student>/course_lib/          their course_lib, as in their student edition
    nbgrader autograde notebooks
    nbgrader generate_feedback notebooks               # grading/feedback/<student>/notebooks/*.html
    nbgrader export                                    # grades.csv: one row per student and notebook

Where a learner's course_lib is found: autograde copies only grading/submitted/<student>/notebooks/
to grading/autograded/<student>/notebooks/ and runs each notebook there. A graded cell of
an exercise region (practice/judging/notebook.py, ``grade_exercise("chNN.name")``) then grades
grading/submitted/<student>/course_lib/ (the folder beside the autograded copy's twin)
with ``python practice/judge.py test chNN --root grading/submitted/<student> --exercise chNN.name``;
no course_lib/ handed in scores 0 with that reason. The judge used is the practice/ found
above the notebook (this repository's, with hidden tests, since grading/ is inside it);
with a course folder elsewhere, set $COURSE_PRACTICE_DIR to this repository's practice/.
$COURSE_SUBMISSION_ROOT overrides the learner's folder. A cell whose GPU cases could not
run on this machine scores 0 ("incomplete"): autograde GPU chapters on a GPU machine.

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
