"""Errors gradaudit raises on purpose; each message says what failed and what to do."""


class GradauditError(Exception):
    """Base class: the message is one or two lines meant for a person."""


class NothingRequiresGradError(GradauditError):
    """The forward built no autograd graph, so there is nothing to audit."""


class ForwardError(GradauditError):
    """The model's forward raised on the given inputs."""
