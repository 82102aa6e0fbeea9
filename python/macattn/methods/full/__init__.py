"""Full causal attention as a method: the baseline every other method is measured against, and
the worked example of adding a method (``docs/architecture.md``). docs/spec.md: ordinary softmax
attention over ``[0, m]``."""
