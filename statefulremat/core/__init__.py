"""The core floor: Variables and their kinds, filters, State, the graph walk (split /
merge / update / state / clone), Module, Rngs, containers, pytree registration, stacks
(the layer axis as data), errors and tracing guards. It imports nothing above it; it
draws itself through the hook the display floor registers (``_display_hooks``)."""
