"""Budgets in currency per tenant: reserved at admission, settled when the request leaves the engine.

A tenant's ``budget`` (keys file) bounds what its requests may be charged in total::

    hold()     the request's stated upper bound (prompt + max_tokens of every sample, at the
               reservation rates: cost_config.py) must fit: spent + held + this <= budget,
               else 429 ``budget_exceeded`` naming what is spent and held; the bound is held
    part opened / closed
               each engine request the HTTP request runs (prompts x n, a cascade's attempts)
               opens a part; the meter closes it when it leaves the engine, adding its
               measured cost
    seal()     no more parts will open (the handler is done)
    settle     sealed and every part closed: charge min(measured, held), release the hold;
               what the measured cost passed the bound is recorded as ``overrun`` (the
               machine's, not billed), so no tenant is ever charged past its budget
    cancel()   never reached the engine: the hold is released, nothing charged

Holds are taken on the event loop and settled in the engine thread (the meter closes records
there), hence the lock. Crossing ``budget_soft_limit`` logs one warning per tenant and counts
an alert in /metrics. Spending lives in memory; with ``cost_log`` a restarted server reads its
records back (:meth:`BudgetBook.restore`), counting each request's measured cost as spent (its
charge could only have been lower: a conservative restart, never an overshoot).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.server.admission import Rejected
from tokenmill.server.tenancy import TenantConfig

logger = logging.getLogger("tokenmill.server")


@dataclass
class TenantBudget:
    limit: float
    soft_limit: float
    spent: float = 0.0
    held: float = 0.0
    overrun: float = 0.0
    """Measured cost above the holds it settled against (not charged)."""
    soft_limit_alerts: int = 0
    """Times spending crossed the soft limit (once per tenant, until the budget changes)."""


@dataclass
class BudgetHold:
    """One HTTP request's hold on its tenant's budget."""

    tenant: str
    amount: float
    """The stated upper bound held at admission."""
    measured: float = 0.0
    parts: int = 0
    sealed: bool = False
    done: bool = False
    charged: float = 0.0
    book: BudgetBook | None = field(default=None, repr=False)

    def open_part(self) -> None:
        with self.book.lock:
            self.parts += 1

    def close_part(self, cost: float) -> None:
        """A part left the engine having cost ``cost`` (called by the meter, in the engine thread)."""
        with self.book.lock:
            self.parts -= 1
            self.measured += cost
            self.book._settle_if_done(self)

    def seal(self) -> None:
        with self.book.lock:
            self.sealed = True
            self.book._settle_if_done(self)


class BudgetBook:
    def __init__(self, tenants: list[TenantConfig]) -> None:
        self.lock = threading.Lock()
        self.tenants = {t.name: TenantBudget(t.budget, t.budget_soft_limit or t.budget)
                        for t in tenants if t.budget > 0}

    def __contains__(self, tenant: str) -> bool:
        return tenant in self.tenants

    def restore(self, cost_log: str | Path) -> int:
        """Count the records of a cost log (cost.py's JSON lines) as spent by their tenants -> how
        many were read; a missing file is an empty log, an unreadable line is skipped with a warning."""
        path = Path(cost_log)
        if not path.exists():
            return 0
        read = 0
        with self.lock:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    entry = json.loads(line)
                    tenant, cost = entry["tenant"], float(entry["cost"])
                except (ValueError, KeyError, TypeError):
                    logger.warning("%s:%d is not a cost record; skipped", path, number)
                    continue
                read += 1
                if tenant in self.tenants:
                    self.tenants[tenant].spent += cost
        return read

    def hold(self, tenant: TenantConfig, amount: float) -> BudgetHold | None:
        """Hold ``amount`` of the tenant's budget (None for a tenant without one), or raise Rejected 429."""
        budget = self.tenants.get(tenant.name)
        if budget is None:
            return None
        with self.lock:
            if budget.spent + budget.held + amount > budget.limit:
                left = max(budget.limit - budget.spent - budget.held, 0.0)
                raise Rejected(429, "budget_exceeded", f"tenant {tenant.name!r} has spent {budget.spent:.6g} and "
                               f"holds {budget.held:.6g} for requests in flight of its budget of {budget.limit:.6g}; "
                               f"this request may cost up to {amount:.6g} (prompt + max_tokens at the reservation "
                               f"rates) and {left:.6g} is left: lower max_tokens or raise the budget", 1)
            budget.held += amount
            return BudgetHold(tenant.name, amount, book=self)

    def cancel(self, hold: BudgetHold) -> None:
        """Release a hold whose request never reached the engine."""
        with self.lock:
            if hold.done:
                return
            hold.done = True
            self.tenants[hold.tenant].held -= hold.amount

    def _settle_if_done(self, hold: BudgetHold) -> None:  # under self.lock
        if hold.done or not hold.sealed or hold.parts > 0:
            return
        hold.done = True
        budget = self.tenants[hold.tenant]
        hold.charged = min(hold.measured, hold.amount)
        budget.held -= hold.amount
        budget.spent += hold.charged
        budget.overrun += hold.measured - hold.charged
        if budget.spent >= budget.soft_limit and not budget.soft_limit_alerts:
            budget.soft_limit_alerts += 1
            logger.warning("tenant %r passed its budget's soft limit: %.6g spent of %.6g (soft limit %.6g)",
                           hold.tenant, budget.spent, budget.limit, budget.soft_limit)

    def snapshot(self) -> dict[str, TenantBudget]:
        with self.lock:
            return {name: TenantBudget(**vars(b)) for name, b in self.tenants.items()}
