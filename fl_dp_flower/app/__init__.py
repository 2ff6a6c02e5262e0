"""The reference app: a client of the library's public API like any user's app (the library never imports it).

- ``config``, ``config_*``: the run config (pydantic; errors name the dash key) and its docs page;
  ``presets``: named run configs; ``strategy``: the library's strategy built from a run config
- ``serverapp``, ``clientapp``: the Flower ServerApp and ClientApp (``server_app.py``, ``client_app.py``
  at the repository root are their entry points); ``recovery``, ``threat``: what a stopped run
  leaves its operator, what a threat model lets a run publish
- ``launcher``, ``local_flower``, ``run_plan``, ``run_output``, ``app_project``: ``fl-dp-flower run``
- ``cli``, ``plan_flags``, ``preflight``, ``audit_commands``: the command line and its planning flags
- ``testing``: the app in process (tiny run config, the real ServerApp on a LocalGrid)
"""
