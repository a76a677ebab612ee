"""The run configuration: `schema` (typed dataclasses and defaults), `validation` (the checks that
refuse a bad config before launch, exit 2), `load` (YAML + `key=value` overrides -> validated Config),
`doc` (the key listing: `python -m launcher.config [section ...]`)."""
