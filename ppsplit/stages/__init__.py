"""From a model to stages that keep its FQNs: export, the split points, the stage graphs and their
code, the plan that balances them, the check of their FQNs against the model, and when two numbers
count as equal. May import: ``config``, ``models``."""
