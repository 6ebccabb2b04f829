from django.db import models


class Handled(models.Model):
    """One row per handler run that committed: the ledger that shows
    exactly-once (atomic handlers) and at-least-once (the others)."""

    message_id = models.BigIntegerField(db_index=True)
    topic = models.CharField(max_length=200)
    attempt = models.IntegerField()
    pid = models.IntegerField()
    handled_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"{self.topic} #{self.message_id} (attempt {self.attempt})"


class Order(models.Model):
    """An order of the demo shop: the business row that the async views
    write with their message (demo.views.place_order_with_writes)."""

    customer = models.CharField(max_length=200)
    placed_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"order #{self.pk} of {self.customer}"
