# Installed as the package ``gradaudit.templates`` (see pyproject.toml) so the HTML report's
# jinja2 templates ship with the wheel while living at the repository's top level.
