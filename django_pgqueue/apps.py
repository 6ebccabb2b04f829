import django
from django.apps import AppConfig
from django.core.signals import setting_changed
from django.db.models.signals import post_migrate


class PgQueueConfig(AppConfig):
    name = "django_pgqueue"
    label = "django_pgqueue"
    verbose_name = "Message queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from django_pgqueue import checks, conf, notify, registry
        from django_pgqueue.observability import alerts
        from django_pgqueue.signals import dead_lettered

        checks.register()
        # Secret settings never show on Django's debug page (see conf.Secret).
        conf.hide_secrets()
        setting_changed.connect(_hide_changed_secrets, dispatch_uid="django_pgqueue.secrets")
        # Keep the insert trigger's state in step with PGQUEUE["NOTIFY"].
        post_migrate.connect(notify.sync_trigger_after_migrate, sender=self)
        # Dead-letter alerts (they do nothing while ALERT_WEBHOOK_URL is None).
        dead_lettered.connect(alerts.on_dead_lettered, dispatch_uid="django_pgqueue.alerts")
        registry.autodiscover()  # every installed app's handlers module, ours too
        from django_pgqueue.streams import subscribers

        subscribers.autodiscover()  # streams: every installed app's subscribers module
        if django.VERSION >= (6, 0):
            # The django.tasks backend: its handler runs tasks in the worker.
            from django_pgqueue import tasks  # noqa: F401


def _hide_changed_secrets(setting, value, **kwargs):
    if setting == "PGQUEUE":
        from django_pgqueue import conf

        conf.hide_secrets(value)
