"""Errors gradaudit raises on purpose; each message says what failed and what to do."""


class GradauditError(Exception):
    """Base class: the message is one or two lines meant for a person."""


class NothingRequiresGradError(GradauditError):
    """The forward built no autograd graph, so there is nothing to audit."""


class ForwardError(GradauditError):
    """The model's forward raised on the given inputs."""


class LoadError(GradauditError):
    """The SPEC could not be turned into a model or inputs (exit code 2 on the command line)."""


class DeclarationError(GradauditError, ValueError):
    """An op-knowledge declaration (``gradaudit.declare``) contradicts itself or an earlier one."""


class RuleError(GradauditError, ValueError):
    """A rule registration is malformed or registers a code or name twice."""


class UnknownRuleError(GradauditError, KeyError):
    """No rule has this code (``gradaudit explain GA999``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownCodeError(GradauditError, ValueError):
    """A select/ignore/allow entry is a prefix of no rule code (``GA4O1``, ``GA9999``): taken
    silently it would select nothing, or ignore nothing, and quietly change what a CI gate checks."""


class NoMatchingParameterError(GradauditError, ValueError):
    """A trainable/frozen glob matches no parameter name: the what-if would silently audit another
    freezing pattern than the one asked for."""


class RenderError(GradauditError):
    """Graphviz's ``dot`` failed to lay out the autograd graph."""


class LoopChangeWarning(UserWarning):
    """A fit's remedy was installed on the model, and its other part is the training loop's to make (its
    micro-batches): without it the step does not fit (``Remedy.micro_batches_of`` splits a batch)."""
