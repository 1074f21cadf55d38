"""The service behind the facade (`ttrace_core.api`): the comparison cache, jobs, tensor views, the dashboard launcher.

Imports every stage and workflow.
"""
